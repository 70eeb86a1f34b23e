"""Where each row stops, exactly where plain ``generate`` stops it: EOS, the token budget, the stopping criteria."""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .batch import ActiveBatch
from .processing import RowCriteria


class RowStopping:
    """Clips each round's tokens where plain ``generate`` would stop the row.

    EOS and the token budget are enforced on the device (a round's tokens are clipped after the first EOS). The
    other criteria (stop strings, custom ones) are evaluated after every committed token, on exactly the
    ``input_ids`` and processed ``scores`` plain ``generate`` would pass them (``processing.RowCriteria``); that
    costs two host synchronisations per round, only when there are such criteria: the round's counts (each row's
    inputs are built on the host) and the criteria's verdicts.
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
        others = [c for c in (criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.criteria = RowCriteria(StoppingCriteriaList(others), input_ids)
        self.stopped_at: dict[int, int] = {}  # no EOS: caller row -> generated tokens when a criterion stopped it
        self.batch_size = input_ids.shape[0]
        self.end_at: int | None = None  # no EOS: the batch ends here once every row has stopped (as in `generate`)

    def budget(self, batch: ActiveBatch) -> int:
        """The most tokens any row generates: ``max_new_tokens``, or fewer once criteria stopped every row."""
        return batch.budget if self.end_at is None else min(batch.budget, self.end_at)

    def after_prefill(self, batch: ActiveBatch, scores: torch.Tensor) -> torch.Tensor:
        """``[B]`` rows that end with the first generated token (``scores [B, V]``: its processed scores)."""
        first = batch.last_tokens
        stop = batch.num_generated >= self.budget(batch)
        if self.eos is not None:
            stop = stop | torch.isin(first, self.eos)
        if self.criteria:
            at = self.criteria.stop_at(batch, first[:, None], [1] * first.shape[0], scores[:, None], committed=0)
            hit = torch.tensor([j is not None for j in at], device=stop.device)
            if self.eos is None:
                self._end_when_all_stopped(batch, at, [0] * len(at))  # the first token: nothing committed before
                stop = stop | (batch.num_generated >= self.budget(batch))
            else:
                stop = stop | hit
        return stop

    def clip(
        self, batch: ActiveBatch, new_tokens: torch.Tensor, counts: torch.Tensor, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``counts`` clipped after each row's first stopping token among its kept tokens, and ``[B]`` rows that stop.

        ``new_tokens``/``scores``: ``[B, K+1]`` tokens of the round and ``[B, K+1, V]`` their processed scores.
        """
        stop = torch.zeros_like(counts, dtype=torch.bool)
        if self.eos is not None:
            steps = torch.arange(new_tokens.shape[1], device=new_tokens.device)
            is_eos = torch.isin(new_tokens, self.eos) & (steps[None] < counts[:, None])
            stop = is_eos.any(-1)
            counts = torch.where(stop, is_eos.float().argmax(-1) + 1, counts)
        if self.criteria:
            at = self.criteria.stop_at(batch, new_tokens, counts.tolist(), scores)
            hit = torch.tensor([j is not None for j in at], device=counts.device)
            if self.eos is None:  # the row goes on; the batch ends once every row has stopped
                self._end_when_all_stopped(batch, at, batch.host.generated)
                counts = torch.minimum(counts, (self.budget(batch) - batch.num_generated).clamp(min=0))
            else:
                first = torch.tensor([j if j is not None else 0 for j in at], device=counts.device)
                counts = torch.where(hit, first + 1, counts)
                stop = stop | hit
        return counts, stop

    def _end_when_all_stopped(self, batch: ActiveBatch, at: list[int | None], committed: list[int]) -> None:
        """Record where criteria stopped rows (``committed`` tokens before the round); end the batch once all have."""
        for row, first in enumerate(at):
            if first is not None and batch.host.rows[row] not in self.stopped_at:
                self.stopped_at[batch.host.rows[row]] = committed[row] + first + 1
        if len(self.stopped_at) == self.batch_size:
            self.end_at = max(self.stopped_at.values())
