"""Logits processors and stopping criteria, called exactly as plain batched ``generate`` calls them.

Plain ``generate`` advances every row of a batch one token at a time, so at each step a processor sees a
``[B, P + n]`` ``input_ids``: each row's left-padded prompt followed by its n generated tokens. In speculative
decoding rows commit different numbers of tokens per round (ragged acceptance) and evaluate K + 1 positions at once,
so :class:`RowProcessors` rebuilds, for every row and position, exactly that row's ``input_ids`` (its padded prompt,
its committed tokens, then the round's tentative tokens before the position) and calls the processors once per
group of rows of equal length.

A call covers a subset of the caller's rows. Most of Transformers' processors are pure functions of their rows, and
those that hold per-row tensors (``RepetitionPenaltyLogitsProcessor``'s ``prompt_ignore_length``) see them sliced to
the same rows for the call. Processors this module cannot vouch for (user-supplied ones, and Transformers' stateful
or row-indexed ones such as ``PrefixConstrainedLogitsProcessor``) are called on the whole original batch instead,
every other row filled with its own tokens up to the same length, and only the group's rows of the result are used:
rows never leave their batch as far as such a processor can tell.

Processors that never read ``input_ids`` (temperature, top-k/p, min-p, ...: :func:`reads_input_ids`) need none of
this: they run once over all ``B x (K + 1)`` positions of a round (:func:`process_flat`).

:class:`TokenSelector` turns a drafter's logits into candidates through the same processors.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

from .batch import ActiveBatch
from .verification import select_tokens

# Transformers' processors and criteria that are pure functions of their rows, so a call on some rows gives those
# rows' results; with the per-row tensors some of them hold, sliced to the rows of the call.
_ROW_WISE = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.RepetitionPenaltyLogitsProcessor,
    lp.NoRepeatNGramLogitsProcessor,
    lp.NoBadWordsLogitsProcessor,
    lp.SequenceBiasLogitsProcessor,
    lp.MinLengthLogitsProcessor,
    lp.MinNewTokensLengthLogitsProcessor,
    lp.SuppressTokensLogitsProcessor,
    lp.SuppressTokensAtBeginLogitsProcessor,
    lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor,
    lp.ExponentialDecayLengthPenalty,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
    sc.StopStringCriteria,
    sc.MaxLengthCriteria,
    sc.EosTokenCriteria,
    sc.ConfidenceCriteria,
)
# Transformers' processors whose output does not depend on ``input_ids`` at all (not even its length): checked by
# reading their ``__call__`` (tests/test_lossless.py holds the list to that).
_PREFIX_FREE = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.LogitNormalization,
    lp.InfNanRemoveLogitsProcessor,
    lp.SuppressTokensLogitsProcessor,
)
_PER_ROW_TENSORS = {lp.RepetitionPenaltyLogitsProcessor: ("prompt_ignore_length",)}


def _sliceable(function: object) -> bool:
    """Whether calling ``function`` on a subset of rows gives those rows' results (see ``_ROW_WISE``)."""
    return type(function) in _ROW_WISE


def reads_input_ids(processors: Sequence[object]) -> bool:
    """Whether any of ``processors`` depends on ``input_ids`` (the prefix or its length).

    Transformers' own are classified by class (``_PREFIX_FREE``); any other processor is assumed to read them
    unless it declares ``reads_input_ids = False`` (an attribute, for user processors that only reshape the scores).
    """
    return any(type(p) not in _PREFIX_FREE and getattr(p, "reads_input_ids", True) is not False for p in processors)


def process_flat(logits: torch.Tensor, processors: LogitsProcessorList) -> torch.Tensor:
    """``[..., V]`` float32 scores after ``processors`` that never read ``input_ids`` (see `reads_input_ids`): one
    call over every position at once."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    no_prefix = torch.empty(flat.shape[0], 0, dtype=torch.long, device=flat.device)
    return processors(no_prefix, flat).view(logits.shape)


@contextlib.contextmanager
def _rows_of(functions: Sequence[object], rows: torch.Tensor) -> Iterator[None]:
    """Within the block, the per-row tensors of ``functions`` (``_PER_ROW_TENSORS``) hold only ``rows``."""
    saved = []
    for function in functions:
        for name in _PER_ROW_TENSORS.get(type(function), ()):
            value = getattr(function, name, None)
            if isinstance(value, torch.Tensor):
                saved.append((function, name, value))
                setattr(function, name, value.index_select(0, rows.to(value.device)))
    try:
        yield
    finally:
        for function, name, value in saved:
            setattr(function, name, value)


class RowInputs:
    """The ``input_ids`` plain batched ``generate`` would show for rows of an :class:`ActiveBatch`.

    Row r (a caller's row) at a position after its n committed tokens and the round's tentative ``extra`` tokens:
    ``[prompt[r] (left-padded, width P), tokens[r, :n], extra]``.
    """

    def __init__(self, prompt: torch.Tensor) -> None:
        self.prompt = prompt  # [B0, P] as the caller passed it (its own left padding)

    def groups(
        self, batch: ActiveBatch, members: Sequence[int] | None = None, committed: int | None = None
    ) -> dict[int, list[int]]:
        """Active rows (``members``, default all) grouped by their committed token count (host values), or all
        with ``committed`` tokens when given."""
        grouped: dict[int, list[int]] = defaultdict(list)
        for row in range(len(batch.host.generated)) if members is None else members:
            grouped[batch.host.generated[row] if committed is None else committed].append(row)
        return grouped

    def build(self, batch: ActiveBatch, rows: torch.Tensor, committed: int, extra: torch.Tensor | None):
        """``[g, P + committed + j]``: inputs of active ``rows`` (each ``committed`` tokens), then ``extra [g, j]``."""
        original = batch.rows.index_select(0, rows)
        parts = [self.prompt.index_select(0, original), batch.tokens.index_select(0, original)[:, :committed]]
        if extra is not None and extra.shape[1]:
            parts.append(extra)
        return torch.cat(parts, dim=1), original

    def full_batch(self, batch: ActiveBatch, rows_input: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
        """``[B0, L]``: ``rows_input`` at its caller rows, every other caller row its own tokens up to length L."""
        length = rows_input.shape[1]
        every = torch.cat([self.prompt, batch.tokens[:, : batch.columns]], dim=1)[:, :length]  # not the scratch column
        # A verify may look past a row's token budget (those positions are never committed): pad the other rows.
        every = torch.nn.functional.pad(every, (0, length - every.shape[1]), value=batch.pad)
        return every.index_copy(0, original, rows_input)


class RowProcessors:
    """The generation's logits processors applied per row exactly as plain batched ``generate`` (module docstring)."""

    def __init__(self, processors: LogitsProcessorList | None, prompt: torch.Tensor) -> None:
        self.processors = processors or LogitsProcessorList()
        self.inputs = RowInputs(prompt)
        self.sliced = all(_sliceable(p) for p in self.processors)
        self.positionwise = reads_input_ids(self.processors)

    def __bool__(self) -> bool:
        return len(self.processors) > 0

    def __call__(self, logits: torch.Tensor, batch: ActiveBatch, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Processed scores ``[B, V]`` (float32) of one position per active row, after ``extra [B, j]`` tokens."""
        scores = logits.float()
        if not self:
            return scores
        out = torch.empty_like(scores)
        for committed, members in self.inputs.groups(batch).items():
            rows = torch.tensor(members, device=scores.device)
            rows_extra = None if extra is None else extra.index_select(0, rows)
            ids, original = self.inputs.build(batch, rows, committed, rows_extra)
            out[rows] = self._apply(batch, ids, scores.index_select(0, rows), original)
        return out

    def _apply(self, batch: ActiveBatch, ids: torch.Tensor, scores: torch.Tensor, original: torch.Tensor):
        batch_size = self.inputs.prompt.shape[0]
        if self.sliced:
            with _rows_of(self.processors, original):
                return self.processors(ids, scores)
        full_scores = scores.new_zeros(batch_size, scores.shape[-1]).index_copy(0, original, scores)
        processed = self.processors(self.inputs.full_batch(batch, ids, original), full_scores)
        return processed.index_select(0, original)

    def block(self, logits: torch.Tensor, batch: ActiveBatch, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, K+1, V]`` scores of K + 1 consecutive positions; position i comes after ``tokens[:, :i]``."""
        if not self:
            return logits.float()
        if not self.positionwise:
            return process_flat(logits, self.processors)
        return torch.stack([self(logits[:, i], batch, tokens[:, :i]) for i in range(logits.shape[1])], dim=1)


class RowCriteria:
    """The generation's stopping criteria (besides EOS and length), evaluated after every committed token."""

    def __init__(self, criteria: StoppingCriteriaList, prompt: torch.Tensor) -> None:
        self.criteria = criteria
        self.inputs = RowInputs(prompt)
        self.sliced = all(_sliceable(c) for c in criteria)

    def __bool__(self) -> bool:
        return len(self.criteria) > 0

    def stop_at(
        self,
        batch: ActiveBatch,
        tokens: torch.Tensor,
        counts: list[int],
        scores: torch.Tensor,
        committed: int | None = None,
    ) -> list[int | None]:
        """For each active row, the index of the first of its ``counts[b]`` new ``tokens`` after which a criterion
        stops the row (``None``: none does). ``scores [B, K+1, V]`` are the processed scores of those positions;
        the new tokens follow each row's committed ones (``committed``: that many for every row instead)."""
        first: list[int | None] = [None] * len(counts)
        batch_size = self.inputs.prompt.shape[0]
        for j in range(max(counts, default=0)):
            pending = [b for b, c in enumerate(counts) if c > j and first[b] is None]
            for done, members in self.inputs.groups(batch, pending, committed).items():
                rows = torch.tensor(members, device=tokens.device)
                ids, original = self.inputs.build(batch, rows, done, tokens.index_select(0, rows)[:, : j + 1])
                row_scores = scores.index_select(0, rows)[:, j]
                if self.sliced:
                    with _rows_of(self.criteria, original):
                        stop = self.criteria(ids, row_scores)
                else:
                    full = row_scores.new_zeros(batch_size, row_scores.shape[-1]).index_copy(0, original, row_scores)
                    stop = self.criteria(self.inputs.full_batch(batch, ids, original), full).index_select(0, original)
                for member, stopped in zip(members, stop.tolist(), strict=True):
                    if stopped:
                        first[member] = j
        return first


Pick = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (slot, scores [B, V]) -> token, drawn from


class TokenSelector:
    """Turns draft logits into candidates with the generation's logits processors, exactly as the target will.

    ``do_sample=False`` takes the argmax (greedy and ``match`` verification); ``True`` samples (``rejection``). In
    the engine the processors see each row's ``input_ids`` exactly as plain batched ``generate`` would
    (`processing.RowProcessors`, attached with :meth:`for_batch`); in Transformers' own assisted loop (one unpadded
    row) the committed ``prefix`` (:meth:`for_prefix`) followed by the round's chosen tokens is that input.
    Processors that never read ``input_ids`` run once over all positions.
    """

    def __init__(self, logits_processor: LogitsProcessorList | None, do_sample: bool) -> None:
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.positionwise = bool(logits_processor) and reads_input_ids(logits_processor)
        self.rows: RowProcessors | None = None
        self.batch: ActiveBatch | None = None
        self.prefix: torch.Tensor | None = None

    def for_batch(self, rows: RowProcessors, batch: ActiveBatch) -> TokenSelector:
        """Process with exact per-row inputs for the rows of ``batch`` (the decoding loop's)."""
        self.rows = rows
        self.batch = batch
        return self

    def for_prefix(self, prefix: torch.Tensor) -> TokenSelector:
        """Process after ``prefix`` ``[1, L]``, the committed tokens of Transformers' assisted loop."""
        self.prefix = prefix
        return self

    def committed_ids(self) -> list[torch.Tensor]:
        """Each row's committed tokens, ``[1, L_b]`` (prompt without padding, then generated): for drafters and
        tests that look at the whole sequence (it synchronises; the engine's drafters never call it)."""
        if self.batch is None:
            return [self.prefix[b : b + 1] for b in range(self.prefix.shape[0])]
        prompt = self.rows.inputs.prompt
        lengths = self.batch.prompt_lengths.tolist()
        return [
            torch.cat([prompt[row, prompt.shape[1] - length :], self.batch.tokens[row, :generated]])[None]
            for row, length, generated in zip(self.batch.host.rows, lengths, self.batch.host.generated, strict=True)
        ]

    def __call__(
        self, logits: torch.Tensor, chosen: torch.Tensor | None = None, pick: Pick | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` ``[B, k, V]`` of k consecutive positions after the committed tokens and the round's already
        ``chosen`` ``[B, j]`` -> tokens ``[B, k]`` and the scores ``[B, k, V]`` each was drawn from (softmax of them
        is the draft ``q``); slot i also sees the i tokens chosen before it in this call. ``pick(i, scores)``
        replaces the argmax / sample of slot i's processed scores (DFlash2's candidate walk)."""
        if self.logits_processor and self.positionwise:
            return self._positionwise(logits, chosen, pick)
        scores = process_flat(logits, self.logits_processor) if self.logits_processor else logits.float()
        if pick is None:
            return select_tokens(scores, self.do_sample), scores
        picked = [pick(i, scores[:, i]) for i in range(scores.shape[1])]
        return torch.stack([t for t, _ in picked], dim=1), torch.stack([q for _, q in picked], dim=1)

    def _positionwise(self, logits: torch.Tensor, chosen: torch.Tensor | None, pick: Pick | None):
        tokens, scores = [], []
        before = [chosen] if chosen is not None else []
        for i in range(logits.shape[1]):
            extra = torch.cat([*before, *[t[:, None] for t in tokens]], dim=1) if before or tokens else None
            if self.rows is not None:
                step = self.rows(logits[:, i], self.batch, extra)
            else:
                seen = self.prefix if extra is None else torch.cat([self.prefix, extra], dim=1)
                step = self.logits_processor(seen, logits[:, i].float())
            token, drawn_from = pick(i, step) if pick is not None else (select_tokens(step, self.do_sample), step)
            tokens.append(token)
            scores.append(drawn_from)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)
