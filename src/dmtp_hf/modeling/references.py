"""Copies that share what models only reference: a draft's target and MTP head, an MTP head's target modules.

Drafts and heads hold these as plain attributes (never submodules: they are neither saved nor moved with the
model). A copy (for example the one a LoRA merge works on) must reference the same objects, not copies of a
multi-GB target. No ``__deepcopy__`` override does it: PEFT wrappers forward unknown attributes to the wrapped model,
so ``copy.deepcopy(peft_model)`` would find the draft's override and copy only the draft.
"""

from __future__ import annotations

import copy

from torch import nn

__all__ = ["SHARED_ATTRIBUTES", "deepcopy_sharing"]

SHARED_ATTRIBUTES = ("_target", "_native_mtp", "_shared")


def deepcopy_sharing(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` in which every module's ``SHARED_ATTRIBUTES`` are the same objects as the original's."""
    memo = {}
    for module in model.modules():
        for name in SHARED_ATTRIBUTES:
            reference = module.__dict__.get(name)
            if reference is not None:
                memo[id(reference)] = reference
    return copy.deepcopy(model, memo)
