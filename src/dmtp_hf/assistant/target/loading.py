"""`load_target`: the one loader of a target model, for generation, training, extraction, regeneration, evaluation."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ...bundled import resolve_target_path
from ...modeling.native_mtp import load_target_checkpoint

__all__ = ["freeze", "load_target"]


def freeze(module: nn.Module) -> nn.Module:
    """``requires_grad_(False)`` + ``eval()``: frozen parts get no gradient and no dropout."""
    module.requires_grad_(False)
    return module.eval()


def load_target(
    path: str | os.PathLike,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device | dict[str, Any] | None = None,
) -> PreTrainedModel:
    """The target causal LM, frozen and in eval mode: what training, feature extraction, regeneration and evaluation
    all load.

    ``path`` may be ``bundled`` for the project's bundled target. ``dtype``: a ``torch.dtype`` or ``"auto"`` (the
    checkpoint's). ``device``: where the weights are loaded (Transformers' ``device_map``: a device, or ``"auto"``
    to spread a big target over this process's GPUs); None keeps Transformers' default (CPU). MTP tensors are
    skipped silently, including at depths where Transformers' hard-coded ignore patterns do not match; the instance
    keeps the fitted patterns, where Transformers' ``MtpModel`` (``use_mtp=True``) finds the MTP tensors.
    """
    kwargs: dict[str, Any] = {"dtype": dtype}
    if device is not None:
        kwargs["device_map"] = device
    target = load_target_checkpoint(resolve_target_path(path), **kwargs)  # + the fitted MTP ignore patterns
    return freeze(target)
