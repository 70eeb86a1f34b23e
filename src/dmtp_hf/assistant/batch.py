"""The rows of a speculative batch: what each has committed, and which are still generating."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .target_step import TargetStep


def append_right_aligned(
    prefix: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, width: int, pad: int
) -> torch.Tensor:
    """Append ``tokens[b, :counts[b]]`` to each row of the right-aligned ``prefix``; keep the last ``width`` columns.

    Rows stay right-aligned: the last column of every row is its last committed token.
    """
    added = tokens.shape[1]
    total = prefix.shape[1] + added
    combined = torch.cat([prefix, tokens], dim=1)  # [B, L + m]; row b's real tokens end at column L + counts[b]
    # Output column j of row b holds combined column j - (m - counts[b]); negative means left padding.
    source = torch.arange(total, device=prefix.device)[None] - (added - counts)[:, None]
    out = combined.gather(1, source.clamp(min=0))
    out = torch.where(source >= 0, out, torch.full_like(out, pad))
    return out[:, total - width :]


@dataclass
class Accepted:
    """What a round commits: ``new_tokens`` ``[B, K+1]`` (accepted candidates, then the bonus), of which the first
    ``counts[b]`` are kept (clipped at EOS, stopping criteria and budget); ``accepted`` ``[B]`` candidates matched."""

    new_tokens: torch.Tensor
    counts: torch.Tensor
    accepted: torch.Tensor
    stop: torch.Tensor  # [B] the row ends with this round

    def committed(self, positions: torch.Tensor, mtp_hidden, features) -> TargetStep:
        """What the drafter learns from this round: the verify's K + 1 positions, the first ``counts[b]`` real."""
        steps = torch.arange(positions.shape[1], device=positions.device)
        return TargetStep(positions, self.new_tokens, steps[None] < self.counts[:, None], mtp_hidden, features)


class ActiveBatch:
    """The rows still generating and everything the loop keeps per row; rows leave when they finish.

    ``tokens`` ``[B0, budget + 1]`` holds every caller row's generated tokens (column ``budget`` is a scratch column
    for writes past a row's end); the per-row tensors below are indexed by *active* row, and ``rows`` maps them back.
    """

    def __init__(self, first: torch.Tensor, prompt_lengths: torch.Tensor, prefix: torch.Tensor, budget: int, pad: int):
        batch, device = first.shape[0], first.device
        self.budget, self.pad = budget, pad
        self.tokens = torch.full((batch, budget + 1), pad, dtype=torch.long, device=device)
        self.tokens[:, 0] = first
        self.num_generated_all = torch.ones(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)
        self.rows_host = list(range(batch))  # the same on the host, for statistics
        self.num_generated = self.num_generated_all.clone()  # [B] per active row
        self.prompt_lengths = prompt_lengths  # [B] real prompt tokens
        self.anchor_positions = prompt_lengths.clone()  # [B] position of A, the last emitted token
        self.prefix = prefix  # [B, L] committed tokens, right-aligned; last column = A
        self.prompt_lengths_host = prompt_lengths.tolist()
        self.generated_host = [1] * batch  # generated tokens per active row
        self.finished = self.num_generated >= budget
        self.finished_host = [budget <= 1] * batch

    @property
    def longest(self) -> int:
        """The most committed tokens (prompt included) of any active row: the width of ``prefix``."""
        return max(p + n for p, n in zip(self.prompt_lengths_host, self.generated_host, strict=True))

    @property
    def done(self) -> bool:
        """Every active row has finished."""
        return all(self.finished_host)

    def stop(self, rows: torch.Tensor) -> None:
        """Mark ``rows`` ``[B]`` (bool) finished (one host sync)."""
        self.finished = self.finished | rows
        self.finished_host = self.finished.tolist()

    def verify_inputs(self, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[A, T1..TK]`` per row and their positions ``a .. a+K`` (both ``[B, K+1]``)."""
        steps = torch.arange(candidates.shape[1] + 1, device=candidates.device)
        return torch.cat([self.prefix[:, -1:], candidates], dim=1), self.anchor_positions[:, None] + steps

    def commit(self, round_: Accepted) -> tuple[list[int], list[int]]:
        """Write each row's kept tokens after its generated ones; returns the counts and acceptances on the host
        (the round's one host synchronisation)."""
        new_tokens, counts = round_.new_tokens, round_.counts
        counts_host, accepted_host, stop_host = torch.stack([counts, round_.accepted, round_.stop.long()]).tolist()
        self.finished = self.finished | round_.stop
        self.finished_host = [a or bool(b) for a, b in zip(self.finished_host, stop_host, strict=True)]
        steps = torch.arange(new_tokens.shape[1], device=counts.device)
        columns = self.num_generated[:, None] + steps[None]
        columns = torch.where(steps[None] < counts[:, None], columns, torch.full_like(columns, self.budget))
        self.tokens[self.rows] = self.tokens[self.rows].scatter(1, columns, new_tokens)
        self.num_generated = self.num_generated + counts
        self.num_generated_all[self.rows] = self.num_generated
        self.generated_host = [n + c for n, c in zip(self.generated_host, counts_host, strict=True)]
        self.prefix = append_right_aligned(self.prefix, new_tokens, counts, self.longest, self.pad)
        return counts_host, accepted_host

    def keep(self, keep: torch.Tensor, keep_host: list[int]) -> None:
        """Only active rows ``keep`` go on; the prefix drops columns that became padding in every row."""
        self.rows, self.num_generated, self.finished = self.rows[keep], self.num_generated[keep], self.finished[keep]
        self.rows_host = [self.rows_host[i] for i in keep_host]
        self.finished_host = [self.finished_host[i] for i in keep_host]
        self.prompt_lengths_host = [self.prompt_lengths_host[i] for i in keep_host]
        self.generated_host = [self.generated_host[i] for i in keep_host]
        self.prompt_lengths, self.anchor_positions = self.prompt_lengths[keep], self.anchor_positions[keep]
        self.prefix = self.prefix[keep][:, self.prefix.shape[1] - self.longest :]

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B0, P + longest generation]``: prompts, generated tokens, then padding (as ``generate`` returns)."""
        longest = min(int(self.num_generated_all.max()), self.budget)  # the budget may end the batch early
        return torch.cat([input_ids, self.tokens[:, :longest]], dim=1)
