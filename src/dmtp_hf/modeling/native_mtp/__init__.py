"""Native MTP heads of real target families, loaded from the target's own checkpoint.

- `layouts`: the family registry (`MTPLayout`, `register_mtp_layout`): where each family keeps its MTP tensors.
- `head`: `NativeMTPHead`, the MTP layer (stateless: pairs -> ``g`` -> logits through the target LM head).
- `loading`: `load_native_mtp`, reading only the MTP tensors (and shards) of the target checkpoint.
- `fp8`: block-scaled FP8 MTP weights (dequantized on load, re-quantized on export).
- `export`: standalone head checkpoints, and a target checkpoint with a new head (`dmtp export-mtp`).
- `retrofit`: a new MTP head for a target that ships none.
- `hidden`: `TargetHiddenExtractor`, the post-norm / pre-norm target hidden fed to the head.
"""

from .export import export_mtp_into_target, save_mtp_head
from .fp8 import dequantize_block_fp8
from .head import HIDDEN_INPUTS, NativeMTPHead
from .hidden import TargetHiddenExtractor
from .layouts import (
    MTPLayout,
    UnsupportedMTPFamilyError,
    build_mtp_layer_config,
    get_mtp_layout,
    register_mtp_layout,
    registered_mtp_layouts,
    resolve_mtp_layout,
)
from .loading import MissingMTPTensorsError, NoNativeMTPError, load_native_mtp, load_target_checkpoint, read_mtp_tensors
from .retrofit import new_mtp_head

__all__ = [
    "HIDDEN_INPUTS",
    "MTPLayout",
    "MissingMTPTensorsError",
    "NativeMTPHead",
    "NoNativeMTPError",
    "TargetHiddenExtractor",
    "UnsupportedMTPFamilyError",
    "build_mtp_layer_config",
    "dequantize_block_fp8",
    "export_mtp_into_target",
    "get_mtp_layout",
    "load_native_mtp",
    "load_target_checkpoint",
    "new_mtp_head",
    "read_mtp_tensors",
    "register_mtp_layout",
    "registered_mtp_layouts",
    "resolve_mtp_layout",
    "save_mtp_head",
]
