"""Where each row stops: EOS, the token budget, and the generation's stopping criteria."""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .batch import ActiveBatch


class RowStopping:
    """EOS clipping of each round's tokens, plus the generation's other stopping criteria.

    EOS and length are enforced per row directly (a round's tokens are clipped after the first EOS); the remaining
    criteria (stop strings, custom ones) see the committed tokens.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        criteria: StoppingCriteriaList | None,
        eos_token_id: torch.Tensor | None,
        pad_token_id: int | None,
    ) -> None:
        eos = eos_token_id.to(input_ids.device).flatten() if eos_token_id is not None else None
        self.eos = eos if eos is not None and eos.numel() else None
        # Finished rows are filled with the pad token (default: the first EOS token, else 0), as in `generate`.
        self.pad = pad_token_id if pad_token_id is not None else (int(self.eos[0]) if self.eos is not None else 0)
        self.criteria = StoppingCriteriaList(
            [c for c in (criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        )

    def after_prefill(self, batch: ActiveBatch) -> torch.Tensor:
        """``[B]`` rows that end with the first generated token."""
        first = batch.prefix[:, -1]
        stop = batch.num_generated >= batch.budget
        if self.eos is not None:
            stop |= torch.isin(first, self.eos)
        if len(self.criteria):
            stop |= self.criteria(batch.prefix, None)
        return stop

    def clip(
        self, batch: ActiveBatch, new_tokens: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``counts`` clipped after each row's first EOS among its kept tokens, and ``[B]`` rows that stop."""
        if self.eos is None:
            return counts, torch.zeros_like(counts, dtype=torch.bool)
        steps = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        is_eos = torch.isin(new_tokens, self.eos) & (steps[None] < counts[:, None])
        hit = is_eos.any(-1)
        return torch.where(hit, is_eos.float().argmax(-1) + 1, counts), hit

    def after_commit(self, batch: ActiveBatch) -> torch.Tensor:
        """``[B]`` rows the other criteria stop, given the committed tokens."""
        if not len(self.criteria):
            return torch.zeros_like(batch.finished)
        return self.criteria(batch.prefix, None)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Rows left the batch (nothing per row is kept here)."""
