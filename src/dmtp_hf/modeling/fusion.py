"""First-candidate fusion: how the MTP hidden that predicted T1 reaches T1's input slot (docs/design.md §1)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from .configuration_dmtp import DMTPConfig

__all__ = ["FirstCandidateFusion"]


class FirstCandidateFusion(nn.Module):
    """Injects the MTP hidden that predicted T1 into T1's input slot (docs/design.md §1).

    ``residual``:        ``E(T1) + W [RMS_e(E(T1)); RMS_m(h)]``, ``W`` zero-initialised (the main method)
    ``replace``:         ``W [RMS_e(E(T1)); RMS_m(h)]``, ``W`` initialised to pass ``RMS_e(E(T1))`` through
    ``hidden_residual``: ``E(T1) + Up(Down(RMS_m(h)))``, ``Up`` zero-initialised (low rank)
    ``none``:            ``E(T1)``

    ``h`` is detached: the MTP head is frozen and receives no gradient through the fusion.
    """

    def __init__(self, config: DMTPConfig):
        super().__init__()
        self.mode = config.fusion
        hidden, mtp_hidden = config.hidden_size, config.mtp_hidden_size
        if self.mode in ("residual", "replace"):
            self.embedding_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
            self.mtp_norm = Qwen3RMSNorm(mtp_hidden, eps=config.rms_norm_eps)
            self.proj = nn.Linear(hidden + mtp_hidden, hidden, bias=False)
        elif self.mode == "hidden_residual":
            self.mtp_norm = Qwen3RMSNorm(mtp_hidden, eps=config.rms_norm_eps)
            self.down = nn.Linear(mtp_hidden, config.fusion_rank, bias=False)
            self.up = nn.Linear(config.fusion_rank, hidden, bias=False)

        # Read by DMTPPreTrainedModel._init_weights: the documented initialisation of each fusion.
        if self.mode == "residual":
            self.proj._dmtp_init = "zeros"
        elif self.mode == "replace":
            self.proj._dmtp_init = "pass_embedding"
        elif self.mode == "hidden_residual":
            self.up._dmtp_init = "zeros"

    def is_noop(self) -> bool:
        """Whether the fusion returns ``E(T1)`` unchanged (zero residual), so dropping it loses nothing."""
        if self.mode == "none":
            return True
        if self.mode == "residual":
            return not bool(self.proj.weight.any())
        if self.mode == "hidden_residual":
            return not bool(self.up.weight.any())
        return False  # 'replace' never reproduces E(T1) exactly

    def forward(self, t1_embeds: torch.Tensor, mtp_hidden: torch.Tensor | None) -> torch.Tensor:
        """``t1_embeds`` ``[B, H]`` = E(T1); ``mtp_hidden`` ``[B, H_mtp]`` = the MTP hidden that predicted T1."""
        if self.mode == "none":
            return t1_embeds
        if mtp_hidden is None:
            raise ValueError(f"fusion={self.mode!r} needs the MTP hidden state that predicted T1.")
        mtp_hidden = mtp_hidden.detach().to(t1_embeds.dtype)
        if self.mode == "hidden_residual":
            return t1_embeds + self.up(self.down(self.mtp_norm(mtp_hidden)))
        fused = self.proj(torch.cat([self.embedding_norm(t1_embeds), self.mtp_norm(mtp_hidden)], dim=-1))
        return t1_embeds + fused if self.mode == "residual" else fused
