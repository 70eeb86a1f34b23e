"""The draft's state, deferred: what plain steps would have written into the MTP head's and the block's caches, kept
until drafting resumes and written then in one pass.

A DMTP engine's plain step (no request verifies anything) still has to keep the draft's caches current: the MTP
head's layer over the new pairs ``(x_{t+1}, h_t)`` and the block's context K/V, every position, or later rounds
attend to holes. Done step by step that costs a decoder layer and a projection per step, at every batch size, which is
most of what a plain step of a DMTP engine costs over vLLM's own (`reports/vllm`). While the policy decodes plainly
(the race backs off; ``verify: "none"``), the proposer instead stashes each step's rows here (positions, cache slots,
pair tokens, the target's hidden rows) and, when drafting resumes or the stash holds a step's token budget, runs the
head and the context projection over all of them at once, as a chunked prefill would: per request its stashed rows
are one causal query ending at its last stashed position.

Nothing here touches what the target computes: a row that is lost (a request that left before the catch-up) only
leaves the draft's state behind, which costs acceptance, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["CatchUp", "DraftStateStash", "StashedRows"]


@dataclass
class StashedRows:
    """Rows of plain steps, in step order. ``owner`` ``[N]`` (host): each row's request handle; ``positions``,
    ``slots``, ``pair_tokens`` ``[N]``; ``hidden`` ``[N, H]``: the target's last layer at each row (what the head
    reads, before the final norm); ``context`` ``[N, k * H]``: the captured feature layers (the block's context)."""

    owner: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    pair_tokens: torch.Tensor
    hidden: torch.Tensor
    context: torch.Tensor

    def __len__(self) -> int:
        return self.owner.shape[0]

    def select(self, index: torch.Tensor) -> StashedRows:
        """The rows at ``index`` (host indices), in that order."""
        return StashedRows(**{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    @staticmethod
    def cat(parts: list[StashedRows]) -> StashedRows:
        """``parts`` one after another."""
        return StashedRows(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(StashedRows)})


def _take(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor[index.to(tensor.device)]


@dataclass
class CatchUp:
    """What a catch-up pass writes: ``rows`` grouped by the request they belong to, each request's rows at contiguous
    ascending positions; ``batch_rows`` ``[R]`` (host): each request's row in the step's batch; ``query_lengths``
    ``[R]`` (host): its rows; ``seq_lengths`` ``[R]`` (host): its last stashed position + 1 (the causal query of a
    request ends there)."""

    rows: StashedRows
    batch_rows: torch.Tensor
    query_lengths: torch.Tensor
    seq_lengths: torch.Tensor


class DraftStateStash:
    """The rows of plain steps, per request, until a catch-up pass writes them (module docstring). ``budget``: the
    most rows held (a catch-up pass runs over at most this many tokens: vLLM's per-step token budget)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.handles: dict[str, int] = {}  # request id -> the integer its rows carry
        self.parts: list[StashedRows] = []
        self.rows = 0

    def fits(self, rows: int) -> bool:
        """Whether ``rows`` more fit before a catch-up must run."""
        return self.rows + rows <= self.budget

    def add(
        self,
        requests: list[str],
        query_lengths: torch.Tensor,  # [B] host: rows per request
        positions: torch.Tensor,  # [N]
        slots: torch.Tensor,  # [N]
        pair_tokens: torch.Tensor,  # [N]
        hidden: torch.Tensor,  # [N, H]
        context: torch.Tensor,  # [N, k * H]
    ) -> None:
        """One plain step's rows (copies: vLLM reuses the buffers they are views of)."""
        handles = torch.tensor([self.handles.setdefault(r, len(self.handles)) for r in requests], dtype=torch.long)
        owner = handles.repeat_interleave(query_lengths.long())
        tensors = (positions, slots, pair_tokens, hidden, context)
        self.parts.append(StashedRows(owner, *(t[: owner.shape[0]].clone() for t in tensors)))
        self.rows += owner.shape[0]

    def take(self, requests: list[str], alive: set[str] | None = None) -> CatchUp | None:
        """The stashed rows of the requests in this step's batch (``requests``, in batch order), grouped for one
        catch-up pass; the rows of requests not in it stay stashed while ``alive`` (every request vLLM still holds;
        ``None``: keep them all). ``None`` when no request of the batch has rows."""
        if not self.parts:
            return None
        rows = StashedRows.cat(self.parts)
        batch_row = torch.full((len(self.handles),), -1, dtype=torch.long)  # handle -> row in this batch
        for row, request in enumerate(requests):
            handle = self.handles.get(request)
            if handle is not None:
                batch_row[handle] = row
        row_of = batch_row[rows.owner]  # [N]
        present = row_of >= 0
        kept = ~present
        if alive is not None:
            living = torch.tensor([request in alive for request in self.handles], dtype=torch.bool)
            kept &= living[rows.owner]
        leftover = rows.select(kept.nonzero().squeeze(1))
        self.parts = [leftover] if len(leftover) else []
        self.rows = len(leftover)
        if not self.parts:
            self.handles.clear()  # nothing refers to them any more: the map does not grow with every request served
        if not present.any():
            return None
        # grouped by batch row, step order kept within a request
        index = present.nonzero().squeeze(1)
        index = index[torch.sort(row_of[index], stable=True).indices]
        rows, row_of = rows.select(index), row_of[index]
        rows, row_of = _latest_positions(rows, row_of)
        batch_rows, query_lengths = torch.unique_consecutive(row_of, return_counts=True)
        ends = torch.cumsum(query_lengths, 0) - 1
        seq_lengths = rows.positions[ends.to(rows.positions.device)].cpu().long() + 1
        return CatchUp(rows, batch_rows, query_lengths, seq_lengths)


def _latest_positions(rows: StashedRows, row_of: torch.Tensor) -> tuple[StashedRows, torch.Tensor]:
    """Where a request's positions were processed again (vLLM recomputes a preempted request from an earlier
    position), the rows of the later pass: a row is kept only if every later row of its request lies past it."""
    positions = rows.positions.cpu().long()
    span = int(positions.max()) + 1 if positions.numel() else 1
    key = row_of * span + positions  # grouped by request ascending, so one request's keys lie below the next's
    later_min = torch.cummin(key.flip(0), 0).values.flip(0)  # [N]: the least key at or after each row
    after = torch.cat([later_min[1:], torch.tensor([torch.iinfo(torch.long).max])])
    keep = (key < after).nonzero().squeeze(1)
    return rows.select(keep), row_of[keep]
