"""What is saved and loaded: the DMTP draft (DFlash backbone + T1 fusion), its config, and native MTP heads.

Importing this package registers the draft with Transformers' ``AutoConfig``/``AutoModel`` (model type ``dmtp``).
"""

from transformers import AutoConfig, AutoModel

from .attention_masks import AttentionLayout, dflash_visibility, draft_attention_masks
from .binding import check_draft_target_compatibility, guard_unbound_assistants, register_bind_hook
from .configuration_dmtp import ANCHOR_LAYOUTS, FUSIONS, DMTPConfig, build_target_layer_ids
from .modeling_dmtp import DMTPDraftModel, DMTPPreTrainedModel, FirstCandidateFusion
from .native_mtp import (
    MissingMTPTensorsError,
    MTPLayout,
    NativeMTPHead,
    NoNativeMTPError,
    TargetHiddenExtractor,
    UnsupportedMTPFamilyError,
    get_mtp_layout,
    load_native_mtp,
    register_mtp_layout,
)

# Here, not in `dmtp_hf/__init__`: that one loads this package only on first use (a fast `dmtp --help`), and every
# path to the draft class (`from dmtp_hf import DMTPDraftModel`, `from dmtp_hf.modeling import ...`) passes here.
AutoConfig.register(DMTPConfig.model_type, DMTPConfig, exist_ok=True)
AutoModel.register(DMTPConfig, DMTPDraftModel, exist_ok=True)
guard_unbound_assistants()  # an unbound draft given to a hybrid target's generate: "bind it", not "stateful models"

__all__ = [
    "ANCHOR_LAYOUTS",
    "AttentionLayout",
    "FUSIONS",
    "DMTPConfig",
    "DMTPDraftModel",
    "DMTPPreTrainedModel",
    "FirstCandidateFusion",
    "MTPLayout",
    "MissingMTPTensorsError",
    "NativeMTPHead",
    "NoNativeMTPError",
    "TargetHiddenExtractor",
    "UnsupportedMTPFamilyError",
    "build_target_layer_ids",
    "check_draft_target_compatibility",
    "dflash_visibility",
    "draft_attention_masks",
    "get_mtp_layout",
    "load_native_mtp",
    "register_bind_hook",
    "register_mtp_layout",
]
