"""`TargetStep`: what the target just committed, the one thing drafters learn from the target; `DrafterInputs`:
what of a target forward a drafter reads (both the engine's round and Transformers' assisted loop use it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ...modeling.native_mtp.hidden import TargetHiddenExtractor


@dataclass
class TargetStep:
    """Positions the target has just committed, handed to drafters after prefill and after each verify.

    Entry i of row b is target position ``positions[b, i] = t``: ``next_tokens[b, i]`` = ``x_{t+1}`` (the token that
    followed position t), ``mtp_hidden[b, i]`` = ``h_t`` as the MTP head reads it and ``features[b, i]`` = the DFlash
    context features of position t. ``mask[b, i]`` says whether the entry is real: batched rows commit different
    numbers of tokens, and prompts may be left-padded (``None``: all real). ``num_valid`` is the number of real
    entries per row on the host (``None``: all); after a verify the real entries come first.
    """

    positions: torch.Tensor  # [B, n]
    next_tokens: torch.Tensor  # [B, n]
    mask: torch.Tensor | None = None  # [B, n] bool
    mtp_hidden: torch.Tensor | None = None  # [B, n, H]
    features: torch.Tensor | None = None  # [B, n, k*H]
    num_valid: list[int] | None = None  # [B] on the host

    _TENSORS = ("positions", "next_tokens", "mask", "mtp_hidden", "features")

    def _map(self, fn) -> TargetStep:
        tensors = {name: None if (t := getattr(self, name)) is None else fn(t) for name in self._TENSORS}
        return replace(self, **tensors)

    @property
    def width(self) -> int:
        """Entries per row (real or not)."""
        return self.positions.shape[1]

    def valid(self) -> torch.Tensor:
        """``[B, n]`` bool: which entries are real."""
        return self.mask if self.mask is not None else torch.ones_like(self.positions, dtype=torch.bool)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> TargetStep:
        """Only batch ``rows`` (``[B']`` indices; the same on the host)."""
        step = self._map(lambda t: t.index_select(0, rows))
        if self.num_valid is not None:
            step.num_valid = [self.num_valid[i] for i in rows_host]
        return step

    def committed(self) -> TargetStep:
        """After a verify: only the entries some row kept (its first ``num_valid[b]``); no mask when every row kept
        the same number."""
        if self.num_valid is None:
            return self
        width = max(self.num_valid)
        step = self._map(lambda t: t[:, :width])
        if min(self.num_valid) == width:
            step.mask = None
            step.num_valid = None
        return step

    @staticmethod
    def concat(steps: Sequence[TargetStep]) -> TargetStep:
        """Entries of ``steps`` one after another (masks merged; ``None`` if every entry is real)."""
        if len(steps) == 1:
            return steps[0]
        mask = None
        if any(s.mask is not None for s in steps):
            mask = torch.cat([s.valid() for s in steps], dim=1)
        counts = [s.num_valid or [s.width] * s.positions.shape[0] for s in steps]
        num_valid = None if all(s.num_valid is None for s in steps) else [sum(c) for c in zip(*counts, strict=True)]

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(s, name) for s in steps]
            return None if any(p is None for p in parts) else torch.cat(parts, dim=1)

        return TargetStep(cat("positions"), cat("next_tokens"), mask, cat("mtp_hidden"), cat("features"), num_valid)


class DrafterInputs:
    """What a drafter reads from each target forward: the context features (the hidden states after its
    ``target_layer_ids``, concatenated) and the hidden state the MTP head reads (captured by a hook on the target).
    Only what the drafter needs is asked for; call :meth:`close` to detach the hook."""

    def __init__(self, target, drafter) -> None:
        # hidden_states[0] is the embedding output, so layer i's output is hidden_states[i + 1]
        self.hidden_indices = [i + 1 for i in drafter.target_layer_ids()] if drafter.needs_features else []
        self.extractor = TargetHiddenExtractor(target, drafter.hidden_input) if drafter.needs_mtp_hidden else None

    def read(self, outputs, rows: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(features [B, n, k*H], mtp_hidden [B, n, H])`` of the forward that produced ``outputs`` (its first
        ``rows`` positions when given), ``None`` for what the drafter does not read."""
        features = mtp_hidden = None
        if self.hidden_indices:
            features = torch.cat([outputs.hidden_states[i][:, :rows] for i in self.hidden_indices], dim=-1)
        if self.extractor is not None:
            mtp_hidden = self.extractor()[:, :rows]
        return features, mtp_hidden

    def close(self) -> None:
        """Detach the MTP-hidden hook."""
        if self.extractor is not None:
            self.extractor.remove()
