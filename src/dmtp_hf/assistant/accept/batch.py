"""The rows of a speculative batch: what each has committed, and which are still generating."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..target.step import TargetStep

INITIAL_COLUMNS = 256  # generated tokens held per row before the buffers first grow (then they double)
# A budget no call reaches (2**62 tokens), so that ``max_new_tokens`` as large as Python allows fits a long tensor.
UNREACHABLE_BUDGET = 1 << 62


def widened(buffer: torch.Tensor, kept: int, columns: int, fill) -> torch.Tensor:
    """``buffer`` ``[B, c, ...]`` with ``columns`` + 1 columns (the last is scratch), its first ``kept`` kept and
    every other one ``fill``."""
    grown = buffer.new_full((buffer.shape[0], columns + 1, *buffer.shape[2:]), fill)
    grown[:, :kept] = buffer[:, :kept]
    return grown


@dataclass
class Accepted:
    """What a round commits: ``new_tokens`` ``[B, k+1]`` (accepted candidates, then the bonus), of which the first
    ``counts[b]`` are kept (clipped at EOS, stopping criteria and budget); ``accepted`` ``[B]`` candidates matched."""

    new_tokens: torch.Tensor
    counts: torch.Tensor
    accepted: torch.Tensor
    stop: torch.Tensor  # [B] the row ends with this round

    def committed(self, positions: torch.Tensor, mtp_hidden, features, counts_host: list[int]) -> TargetStep:
        """What the drafter learns from this round: the verify's positions, the first ``counts[b]`` real."""
        steps = torch.arange(positions.shape[1], device=positions.device)
        valid = steps[None] < self.counts[:, None]
        return TargetStep(positions, self.new_tokens, valid, mtp_hidden, features, counts_host)


class StepOutputs:
    """What ``output_scores`` / ``output_logits`` ask for: each generated token's processed scores and raw logits,
    ``[B0, V]`` per step as plain ``generate`` returns them. Steps after a row has finished hold ``-inf`` (plain
    ``generate`` computes scores on padding there; a speculative batch does no work for finished rows). The
    buffers ``[B0, columns + 1, V]`` have as many columns as `ActiveBatch.tokens` and grow with them."""

    def __init__(self, scores: bool, logits: bool) -> None:
        self.wanted = {"scores": scores, "logits": logits}
        self.buffers: dict[str, torch.Tensor] = {}

    def write(self, rows: torch.Tensor, columns: torch.Tensor, num_columns: int, batch_size: int, **values) -> None:
        """``values[name]`` ``[B, k+1, V]`` at the caller ``rows`` ``[B]`` and token ``columns`` ``[B, k+1]``."""
        for name, value in values.items():
            if not self.wanted[name] or value is None:
                continue
            if name not in self.buffers:
                shape = (batch_size, num_columns + 1, value.shape[-1])
                self.buffers[name] = torch.full(shape, float("-inf"), dtype=torch.float32, device=value.device)
            index = (rows[:, None].expand_as(columns), columns)
            self.buffers[name].index_put_(index, value[:, : columns.shape[1]].float())

    def grow(self, old_columns: int, num_columns: int) -> None:
        """Widen every buffer to ``num_columns`` token columns (plus the scratch one), keeping what is written."""
        for name, buffer in self.buffers.items():
            self.buffers[name] = widened(buffer, old_columns, num_columns, float("-inf"))

    def steps(self, name: str, length: int) -> tuple[torch.Tensor, ...] | None:
        """The first ``length`` steps of ``name`` as a tuple of ``[B0, V]`` tensors (``None`` if not asked for)."""
        buffer = self.buffers.get(name)
        return None if buffer is None else tuple(buffer[:, step] for step in range(length))


@dataclass
class HostRows:
    """The active rows as the host sees them, refreshed from one synchronisation per round."""

    rows: list[int]  # the caller's row of each active row
    generated: list[int]  # tokens generated so far, per active row
    finished: list[bool]

    @property
    def done(self) -> bool:
        """Every active row has finished."""
        return all(self.finished)

    def keep(self, keep_host: list[int]) -> HostRows:
        """Only active rows ``keep_host``."""
        return HostRows(*([values[i] for i in keep_host] for values in (self.rows, self.generated, self.finished)))


@dataclass
class RoundHost:
    """The host copy of one round's outcome per active row (the round's one synchronisation)."""

    counts: list[int]  # tokens committed
    accepted: list[int]  # candidates accepted


class ActiveBatch:
    """The rows still generating and everything the loop keeps per row on the device; rows leave when they finish.

    ``tokens`` ``[B0, columns + 1]`` holds every caller row's generated tokens; the last column is scratch, for
    writes past a row's end. It grows with the tokens generated (doubling, up to the budget), never sized by
    ``max_new_tokens``, so a large budget costs nothing until it is used. The per-row tensors below are indexed by
    *active* row, and ``rows`` maps them back. :attr:`host` is the host's view of the same rows.
    """

    def __init__(
        self, first: torch.Tensor, prompt_lengths: torch.Tensor, budget: int, pad: int, outputs: StepOutputs | None
    ):
        batch = first.shape[0]
        device = first.device
        self.outputs = outputs
        self.budget = min(budget, UNREACHABLE_BUDGET)  # what every comparison below uses: it fits a long tensor
        self.pad = pad
        self.columns = min(self.budget, INITIAL_COLUMNS)
        self.tokens = torch.full((batch, self.columns + 1), pad, dtype=torch.long, device=device)
        self.tokens[:, 0] = first
        self.num_generated_all = torch.ones(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)
        self.num_generated = self.num_generated_all.clone()  # [B] per active row
        self.prompt_lengths = prompt_lengths  # [B] real prompt tokens
        self.anchor_positions = prompt_lengths.clone()  # [B] position of A, the last emitted token
        self.last_tokens = first  # [B] A itself
        self.finished = self.num_generated >= self.budget
        self.host = HostRows(list(range(batch)), [1] * batch, [self.budget <= 1] * batch)

    @property
    def done(self) -> bool:
        """Every active row has finished."""
        return self.host.done

    def stop(self, rows: torch.Tensor) -> None:
        """Mark ``rows`` ``[B]`` (bool) finished (one host sync)."""
        self.finished = self.finished | rows
        self.host.finished = self.finished.tolist()

    def verify_inputs(self, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[A, T1..Tk]`` per row and their positions ``a .. a+k`` (both ``[B, k+1]``)."""
        steps = torch.arange(candidates.shape[1] + 1, device=candidates.device)
        return torch.cat([self.last_tokens[:, None], candidates], dim=1), self.anchor_positions[:, None] + steps

    def record(self, columns: torch.Tensor, scores=None, logits=None) -> None:
        """Keep the scores / raw logits of the tokens written at ``columns`` ``[B, k+1]`` (when asked for)."""
        if self.outputs is not None:
            self.outputs.write(self.rows, columns, self.columns, self.tokens.shape[0], scores=scores, logits=logits)

    def reserve(self, width: int) -> None:
        """Room for ``width`` more tokens in every active row (the host knows how many each has: no sync)."""
        needed = min(max(self.host.generated, default=0) + width, self.budget)
        if needed <= self.columns:
            return
        old = self.columns
        self.columns = min(max(needed, 2 * old), self.budget)
        self.tokens = widened(self.tokens, old, self.columns, self.pad)
        if self.outputs is not None:
            self.outputs.grow(old, self.columns)

    def commit(self, round_: Accepted, scores=None, logits=None) -> RoundHost:
        """Write each row's kept tokens after its generated ones (in place), with their ``scores`` / ``logits``
        ``[B, k+1, V]`` when `StepOutputs` asks for them; returns the round on the host."""
        new_tokens, counts = round_.new_tokens, round_.counts
        counts_host, accepted_host, stop_host = torch.stack([counts, round_.accepted, round_.stop.long()]).tolist()
        self.finished = self.finished | round_.stop
        self.reserve(new_tokens.shape[1])
        steps = torch.arange(new_tokens.shape[1], device=counts.device)
        columns = self.num_generated[:, None] + steps[None]
        columns = torch.where(steps[None] < counts[:, None], columns, torch.full_like(columns, self.columns))
        self.tokens.index_put_((self.rows[:, None].expand_as(columns), columns), new_tokens)
        self.record(columns, scores, logits)
        last = new_tokens.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
        self.last_tokens = torch.where(counts > 0, last, self.last_tokens)
        self.num_generated = self.num_generated + counts
        self.anchor_positions = self.anchor_positions + counts
        self.num_generated_all[self.rows] = self.num_generated
        self.host.generated = [n + c for n, c in zip(self.host.generated, counts_host, strict=True)]
        self.host.finished = [a or bool(b) for a, b in zip(self.host.finished, stop_host, strict=True)]
        return RoundHost(counts_host, accepted_host)

    def keep(self, keep: torch.Tensor, keep_host: list[int]) -> None:
        """Only active rows ``keep`` go on."""
        self.rows = self.rows[keep]
        self.num_generated = self.num_generated[keep]
        self.finished = self.finished[keep]
        self.prompt_lengths = self.prompt_lengths[keep]
        self.anchor_positions = self.anchor_positions[keep]
        self.last_tokens = self.last_tokens[keep]
        self.host = self.host.keep(keep_host)

    def sequences(self, input_ids: torch.Tensor, budget: int | None = None) -> torch.Tensor:
        """``[B0, P + longest generation]``: prompts, generated tokens, then padding (as ``generate`` returns)."""
        budget = self.budget if budget is None else budget
        longest = min(int(self.num_generated_all.max()), budget)  # the budget may end the batch early
        return torch.cat([input_ids, self.tokens[:, :longest]], dim=1)
