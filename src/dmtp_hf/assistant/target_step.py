"""`TargetStep`: what the target just committed, the one thing drafters learn from the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch


@dataclass
class TargetStep:
    """Positions the target has just committed, handed to drafters after prefill and after each verify.

    Entry i of row b is target position ``positions[b, i] = t``: ``next_tokens[b, i]`` = ``x_{t+1}`` (the token that
    followed position t), ``mtp_hidden[b, i]`` = ``h_t`` as the MTP head reads it and ``features[b, i]`` = the DFlash
    context features of position t. ``mask[b, i]`` says whether the entry is real: batched rows commit different
    numbers of tokens, and prompts may be left-padded (``None``: all real).
    """

    positions: torch.Tensor  # [B, n]
    next_tokens: torch.Tensor  # [B, n]
    mask: torch.Tensor | None = None  # [B, n] bool
    mtp_hidden: torch.Tensor | None = None  # [B, n, H]
    features: torch.Tensor | None = None  # [B, n, k*H]

    def _map(self, fn) -> TargetStep:
        return TargetStep(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)})

    def valid(self) -> torch.Tensor:
        """``[B, n]`` bool: which entries are real."""
        return self.mask if self.mask is not None else torch.ones_like(self.positions, dtype=torch.bool)

    def pair_mask(self) -> torch.Tensor | None:
        """The MTP head's 2D pair mask (``None`` when every entry is real, which keeps its unmasked path)."""
        return None if self.mask is None else self.mask.long()

    def select_rows(self, rows: torch.Tensor) -> TargetStep:
        """Only batch ``rows`` (``[B']`` indices)."""
        return self._map(lambda t: t.index_select(0, rows))

    def narrow(self, width: int, all_valid: bool = False) -> TargetStep:
        """The first ``width`` entries of every row; ``all_valid`` drops the mask (the caller knows none is padding)."""
        step = self._map(lambda t: t[:, :width])
        if all_valid:
            step.mask = None
        return step

    @staticmethod
    def concat(steps: Sequence[TargetStep]) -> TargetStep:
        """Entries of ``steps`` one after another (masks merged; ``None`` if every entry is real)."""
        if len(steps) == 1:
            return steps[0]
        mask = None
        if any(s.mask is not None for s in steps):
            mask = torch.cat([s.valid() for s in steps], dim=1)

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(s, name) for s in steps]
            return None if any(p is None for p in parts) else torch.cat(parts, dim=1)

        return TargetStep(cat("positions"), cat("next_tokens"), mask, cat("mtp_hidden"), cat("features"))
