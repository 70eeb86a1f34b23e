"""Drafting strategies on one engine: ``dmtp`` (MTP T1 + DFlash T2..T7), ``dflash`` (7 DFlash proposals) and
``mtp`` (native MTP chained k steps). They share every other line of the decoding loop, so comparisons between
them differ only in how candidates are proposed.

A drafter sees the target only through :class:`TargetStep` (tokens, hidden states and context features of
positions the target has just committed) and returns a :class:`Proposal` per round. Its state between rounds (the
MTP cache, the DFlash context) lives in a backend from ``drafter_state.py``: growing dynamic caches by default,
fixed device-side slots with ``fixed_slots=True`` (CUDA-graph replays on CUDA with ``cuda_graphs``). The backend
changes where tensors live, never the proposals.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from ..modeling.modeling_dmtp import DMTPDraftModel
from ..modeling.native_mtp.head import NativeMTPHead
from .batch import ActiveBatch
from .drafter_state import DFlashContext, MTPCache, MTPSlots, SlotDFlashContext
from .processing import RowProcessors
from .stats import SpecStats
from .target_step import TargetStep
from .verification import process_logits, select_tokens


def _stage(stats: SpecStats | None, name: str):
    return stats.stage(name) if stats is not None else contextlib.nullcontext()


@dataclass
class Proposal:
    """Candidates of one round and, for rejection sampling, the processed scores each was drawn from."""

    tokens: torch.Tensor  # [B, K]
    scores: torch.Tensor | None  # [B, K, V]


class TokenSelector:
    """Turns draft logits into candidates with the generation's logits processors, exactly as the target will.

    ``do_sample=False`` takes the argmax (greedy and ``match`` verification); ``True`` samples (``rejection``). In
    the engine the processors see each row's ``input_ids`` exactly as plain batched ``generate`` would
    (`processing.RowProcessors`, attached with :meth:`for_batch`); elsewhere (Transformers' own assisted loop, one
    unpadded row) the committed ``prefix`` followed by the round's chosen tokens is that input.
    """

    def __init__(self, logits_processor: LogitsProcessorList | None, do_sample: bool) -> None:
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.rows: RowProcessors | None = None
        self.batch: ActiveBatch | None = None

    def for_batch(self, rows: RowProcessors, batch: ActiveBatch) -> TokenSelector:
        """Process with exact per-row inputs for the rows of ``batch`` (the decoding loop's)."""
        self.rows, self.batch = rows, batch
        return self

    def __call__(
        self, logits: torch.Tensor, prefix: torch.Tensor, chosen: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` ``[B, K, V]`` of K consecutive positions -> tokens ``[B, K]``, processed scores ``[B, K, V]``.

        The positions follow the committed tokens (``prefix``, right-aligned) and the round's already ``chosen``
        tokens ``[B, j]``; slot i also sees the i tokens chosen before it in this call.
        """
        if not self.logits_processor:
            scores = logits.float()
            return select_tokens(scores, self.do_sample), scores
        tokens, scores = [], []
        before = [chosen] if chosen is not None else []
        for i in range(logits.shape[1]):
            extra = torch.cat([*before, *[t[:, None] for t in tokens]], dim=1) if before or tokens else None
            if self.rows is not None:
                step = self.rows(logits[:, i], self.batch, extra)
            else:
                seen = prefix if extra is None else torch.cat([prefix, extra], dim=1)
                step = process_logits(logits[:, i], seen, self.logits_processor)
            tokens.append(select_tokens(step, self.do_sample))
            scores.append(step)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)


class Drafter:
    """The interface the decoding loop drives (one round: `propose`, then `advance` with what was committed).

    Attributes the loop reads:
        name: label of the strategy in statistics.
        num_candidates: K, candidates per round.
        needs_features: the target must return the DFlash context features (at :meth:`target_layer_ids`).
        needs_mtp_hidden: the target must provide the hidden state the MTP head reads.
        hidden_input: which one: ``"post_norm"`` (the tensor fed to the LM head) or ``"pre_norm"``.
        fixed_slots: `advance` takes all ``K + 1`` verify slots with a validity mask (fixed shapes, no host sync);
            otherwise only the committed width.
    """

    name = "drafter"
    num_candidates: int
    needs_features = False
    needs_mtp_hidden = False
    hidden_input = "post_norm"
    fixed_slots = False

    def target_layer_ids(self) -> list[int]:
        """Target layers whose outputs form the context features (empty if unused)."""
        return []

    def reserve(self, max_positions: int) -> None:
        """Called before `start` with the longest sequence of the call (fixed slots size their buffers)."""

    def start(self, step: TargetStep) -> None:
        """Initialise the drafter's state from the prompt (after the target prefill)."""
        raise NotImplementedError

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """Propose ``num_candidates`` tokens per row.

        ``prefix`` ``[B, L]`` holds each row's committed tokens right-aligned (left-padded), so ``prefix[:, -1]``
        is A, the last emitted token the target has not processed yet; ``anchor_positions`` ``[B]`` is A's position.
        """
        raise NotImplementedError

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit the positions the last verify accepted (accepted tokens + bonus); MTP work is timed as ``mtp``."""
        raise NotImplementedError

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Keep only batch ``rows`` (finished sequences leave the batch); ``False`` if this drafter cannot."""
        return False


class DrafterWrapper(Drafter):
    """Base for drafters that adjust another drafter's proposals (e.g. constrain or corrupt them for tests and
    benchmarks): everything but :meth:`propose` is forwarded to ``inner``."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.num_candidates = inner.num_candidates
        self.needs_features = inner.needs_features
        self.needs_mtp_hidden = inner.needs_mtp_hidden
        self.hidden_input = inner.hidden_input
        self.fixed_slots = inner.fixed_slots

    def target_layer_ids(self) -> list[int]:
        """The inner drafter's feature layers."""
        return self.inner.target_layer_ids()

    def reserve(self, max_positions: int) -> None:
        """Forwarded to the inner drafter."""
        self.inner.reserve(max_positions)

    def start(self, step: TargetStep) -> None:
        """Forwarded to the inner drafter."""
        self.inner.start(step)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Forwarded to the inner drafter."""
        self.inner.advance(step, stats)

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """The inner drafter's proposal (override to change it)."""
        return self.inner.propose(prefix, anchor_positions, select, stats)

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Forwarded to the inner drafter (override to also select the wrapper's own per-row state)."""
        return self.inner.select_rows(rows)


class _StatefulDrafter(Drafter):
    """Builds the drafter state backends (``fixed_slots`` or dynamic) of the strategies below."""

    def __init__(self, fixed_slots: bool, cuda_graphs: bool) -> None:
        self.fixed_slots = fixed_slots
        self.cuda_graphs = cuda_graphs
        self.capacity: int | None = None  # fixed slots per row, set by `reserve`
        self.mtp: MTPCache | MTPSlots | None = None
        self.context: DFlashContext | SlotDFlashContext | None = None

    def reserve(self, max_positions: int) -> None:
        """Size fixed slots for sequences of up to ``max_positions`` tokens (plus one verify's candidates)."""
        self.capacity = max_positions + self.num_candidates + 1

    def _check_capacity(self, step: TargetStep) -> None:
        """Fixed slots: refuse, before any write, a prompt the reserved capacity cannot hold with one verify."""
        if not self.fixed_slots:
            return
        if self.capacity is None:
            raise ValueError("Fixed-slot drafter state needs its capacity first: call reserve(max_positions).")
        needed = step.positions.shape[1] + self.num_candidates + 1
        if needed > self.capacity:
            raise ValueError(
                f"The prompt ({step.positions.shape[1]} positions) and one verify need {needed} fixed slots per row, "
                f"more than the {self.capacity} reserved: reserve() the longest sequence of the call."
            )

    def _new_mtp_state(self, head: NativeMTPHead) -> MTPCache | MTPSlots:
        """Fixed slots of the same capacity are reused (reset in place by ``prefill``: captured graphs survive)."""
        if not self.fixed_slots:
            return MTPCache(head)
        if isinstance(self.mtp, MTPSlots) and self.mtp.cache.capacity == self.capacity:
            return self.mtp
        return MTPSlots(head, self.capacity, self.cuda_graphs)

    def _new_context(self, draft: DMTPDraftModel) -> DFlashContext | SlotDFlashContext:
        """Fixed slots of the same capacity are reused (reset in place by ``start``: captured graphs survive)."""
        if not self.fixed_slots:
            return DFlashContext(draft)
        if isinstance(self.context, SlotDFlashContext) and self.context.cache.capacity == self.capacity:
            return self.context
        return SlotDFlashContext(draft, self.capacity, self.cuda_graphs)

    def graph_calls(self) -> list:
        """Every captured stage of the fixed-slot state (empty for the dynamic state)."""
        return [
            call for state in (self.mtp, self.context) if hasattr(state, "graph_calls") for call in state.graph_calls()
        ]

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows from every piece of state."""
        for state in (self.mtp, self.context):
            if state is not None:
                state.select_rows(rows)
        return True


class DFlashDrafter(_StatefulDrafter):
    """DFlash alone: block ``[A, MASK x K]``, all K candidates from one parallel forward."""

    name = "dflash"
    needs_features = True

    def __init__(self, draft: DMTPDraftModel, *, fixed_slots: bool = False, cuda_graphs: bool = True) -> None:
        if draft.config.anchor_layout != "dflash":
            raise ValueError(
                "DFlashDrafter needs a draft with anchor_layout='dflash' "
                f"(got {draft.config.anchor_layout!r}); load it with anchor_layout='dflash'."
            )
        super().__init__(fixed_slots, cuda_graphs)
        self.draft = draft
        self.num_candidates = draft.config.num_candidates

    def target_layer_ids(self) -> list[int]:
        """The draft's feature layers."""
        return list(self.draft.config.target_layer_ids)

    def start(self, step: TargetStep) -> None:
        """Fresh context holding the prompt features."""
        self._check_capacity(step)
        self.context = self._new_context(self.draft)
        self.context.start(step)

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """``[A, MASK x K]`` -> K candidates."""
        with stats.stage("dflash"):
            logits = self.context.candidate_logits(self.draft.block_embeddings(prefix[:, -1]), anchor_positions)
            tokens, scores = select(logits, prefix)
        return Proposal(tokens, scores)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Queue the accepted positions' features."""
        self.context.add(step)


class MTPDrafter(_StatefulDrafter):
    """Native MTP-k: the target's MTP head chained k times (k = 4 is the blog's MTP415)."""

    needs_mtp_hidden = True

    def __init__(
        self, mtp_head: NativeMTPHead, num_steps: int = 1, *, fixed_slots: bool = False, cuda_graphs: bool = True
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        super().__init__(fixed_slots, cuda_graphs)
        self.head = mtp_head
        self.hidden_input = mtp_head.hidden_input
        self.num_candidates = num_steps
        self.name = f"mtp{num_steps}"

    def start(self, step: TargetStep) -> None:
        """Prefill the MTP state over all prompt pairs."""
        self._check_capacity(step)
        self.mtp = self._new_mtp_state(self.head)
        with torch.no_grad():
            self.mtp.prefill(step)

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """Chain the MTP layer k times; each step is selected with the processors and the prefix it extends."""
        chosen: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []

        def select_step(logits: torch.Tensor) -> torch.Tensor:
            token, score = select(logits[:, None], prefix, torch.stack(chosen, dim=1) if chosen else None)
            chosen.append(token[:, 0])
            scores.append(score[:, 0])
            return token[:, 0]

        with stats.stage("mtp"), torch.no_grad():
            tokens, _ = self.mtp.propose(self.num_candidates, select_step)
        return Proposal(tokens, torch.stack(scores, dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit the accepted pairs to the MTP state."""
        with _stage(stats, "mtp"), torch.no_grad():
            self.mtp.advance(step)


class DMTPDrafter(_StatefulDrafter):
    """DMTP: the native MTP head proposes T1, the DFlash draft T2..T7 conditioned on T1 and its MTP hidden."""

    name = "dmtp"
    needs_features = True
    needs_mtp_hidden = True

    def __init__(
        self,
        draft: DMTPDraftModel,
        mtp_head: NativeMTPHead,
        *,
        fixed_slots: bool = False,
        cuda_graphs: bool = True,
    ) -> None:
        if draft.config.anchor_layout == "dflash":
            raise ValueError("DMTPDrafter needs anchor_layout 'single' or 'dual'; use DFlashDrafter for 'dflash'.")
        super().__init__(fixed_slots, cuda_graphs)
        self.draft = draft
        self.head = mtp_head
        self.hidden_input = mtp_head.hidden_input
        self.num_candidates = draft.config.num_candidates

    def target_layer_ids(self) -> list[int]:
        """The draft's feature layers."""
        return list(self.draft.config.target_layer_ids)

    def start(self, step: TargetStep) -> None:
        """Prefill the MTP state over the prompt pairs and queue the prompt features for DFlash."""
        self._check_capacity(step)
        self.mtp = self._new_mtp_state(self.head)
        self.context = self._new_context(self.draft)
        self.context.start(step)
        with torch.no_grad():
            self.mtp.prefill(step)

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """T1 from the cached MTP hidden, fusion, one DFlash forward for T2..T7."""
        with stats.stage("t1_fusion"):
            t1_logits, mtp_hidden = self.mtp.predict()  # the MTP hidden that predicts T1
            t1, t1_scores = select(t1_logits[:, None], prefix)
            block = self.draft.block_embeddings(prefix[:, -1], t1[:, 0], mtp_hidden)
        with stats.stage("dflash"):
            logits = self.context.candidate_logits(block, anchor_positions)
            rest, rest_scores = select(logits, prefix, chosen=t1)
        return Proposal(torch.cat([t1, rest], dim=1), torch.cat([t1_scores, rest_scores], dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit accepted pairs to the MTP state (its next ``g`` predicts the next T1); queue DFlash context."""
        self.context.add(step)
        with _stage(stats, "mtp"), torch.no_grad():
            self.mtp.advance(step)
