"""What is saved and loaded: the DMTP draft (DFlash backbone + T1 fusion), its config, and native MTP heads."""

from .configuration_dmtp import ANCHOR_LAYOUTS, FUSIONS, DMTPConfig, build_target_layer_ids
from .modeling_dmtp import (
    DMTPDraftModel,
    DMTPPreTrainedModel,
    FirstCandidateFusion,
    check_draft_target_compatibility,
    dflash_visibility,
)
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

__all__ = [
    "ANCHOR_LAYOUTS",
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
    "get_mtp_layout",
    "load_native_mtp",
    "register_mtp_layout",
]
