"""What is saved and loaded: the DMTP draft (DFlash backbone + T1 fusion) and its config."""

from .configuration_dmtp import ANCHOR_LAYOUTS, FUSIONS, DMTPConfig, build_target_layer_ids
from .modeling_dmtp import (
    DMTPDraftModel,
    DMTPPreTrainedModel,
    FirstCandidateFusion,
    check_draft_target_compatibility,
    dflash_visibility,
)

__all__ = [
    "ANCHOR_LAYOUTS",
    "FUSIONS",
    "DMTPConfig",
    "DMTPDraftModel",
    "DMTPPreTrainedModel",
    "FirstCandidateFusion",
    "build_target_layer_ids",
    "check_draft_target_compatibility",
    "dflash_visibility",
]
