"""What every drafter shares: the interface the round drives (`Drafter`), its proposal (`Proposal`), the state
and width policy of the three strategies (`StatefulDrafter`), and how a DFlash block's slots become candidates
(`block_candidates`, DFlash2's `CandidateWalk`). The strategies themselves: ``dmtp.py`` (MTP T1 + DFlash T2..T7),
``dflash.py`` (7 DFlash proposals), ``mtp.py`` (native MTP chained k steps). They share every other line of the
decoding loop, so comparisons between them differ only in how candidates are proposed.

A drafter sees the target only through :class:`TargetStep` (tokens, hidden states and context features of
positions the target has just committed) and returns a :class:`Proposal` per round. Its state between rounds (the
MTP state, the DFlash context) lives in ``state.py``; ``fixed_shapes`` (the fast path) changes only the
shapes it runs at (CUDA-graph replays on CUDA with ``cuda_graphs``), never the proposals.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...modeling.modeling_dmtp import DMTPDraftModel
from ..accept.processing import TokenSelector
from ..stats import SpecStats
from ..target.step import TargetStep
from ..widths import AllCandidates, RoundWidth
from .state import DFlashContext, MTPState

# The most positions a fixed-shape (fast path) drafter state reserves per row: 2**20 slots of K/V per layer are
# already gigabytes for a real draft; past it a budget means "until EOS", which only a growing state serves.
MAX_FIXED_POSITIONS = 1 << 20


def optional_stage(stats: SpecStats | None, name: str):
    """``stats.stage(name)``, or nothing to time when the caller keeps no statistics."""
    return stats.stage(name) if stats is not None else contextlib.nullcontext()


@dataclass
class Proposal:
    """Candidates of one round and, for rejection sampling, the processed scores each was drawn from."""

    tokens: torch.Tensor  # [B, k], k <= K
    scores: torch.Tensor | None  # [B, k, V]


class CandidateWalk:
    """DFlash2's walk as a `TokenSelector` pick: slot i's processed scores are its unary term, so logits processors
    decide what may be a candidate (a banned token is never one); the walk starts after ``previous`` ``[B]``."""

    def __init__(self, draft: DMTPDraftModel, hidden: torch.Tensor, previous: torch.Tensor, sample: bool) -> None:
        self.selector = draft.candidate_selector
        self.projected = self.selector.hidden_projection(hidden)  # [B, k, r]
        self.previous = previous
        self.sample = sample

    def __call__(self, slot: int, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token of ``slot`` from its processed ``scores`` ``[B, V]``, and the walk's scores over V."""
        token, walk = self.selector.step(scores, self.projected[:, slot], self.previous, self.sample)
        self.previous = token
        return token, walk


def block_candidates(draft, hidden, logits, previous, select: TokenSelector, chosen=None, limit: int | None = None):
    """Candidates of a DFlash block's predicted slots (up to ``limit``): each slot's processed argmax or sample,
    or, with a DFlash2 backbone, the candidate walk from ``previous`` (the token before the first slot)."""
    hidden, logits = hidden[:, :limit], logits[:, :limit]
    if draft.candidate_selector is None:
        return select(logits, chosen)
    return select(logits, chosen, CandidateWalk(draft, hidden, previous, select.do_sample))


class Drafter:
    """The interface the decoding loop drives (one round: `propose`, then `advance` with what was committed).

    Attributes the loop reads:
        name: label of the strategy in statistics.
        num_candidates: K, the most candidates per round.
        needs_features: the target must return the DFlash context features (at :meth:`target_layer_ids`).
        needs_mtp_hidden: the target must provide the hidden state the MTP head reads.
        hidden_input: which one: ``"post_norm"`` (the tensor fed to the LM head) or ``"pre_norm"``.
    """

    name = "drafter"
    num_candidates: int
    needs_features = False
    needs_mtp_hidden = False
    hidden_input = "post_norm"

    def target_layer_ids(self) -> list[int]:
        """Target layers whose outputs form the context features (empty if unused)."""
        return []

    def reserve(self, max_positions: int) -> None:
        """Called before `start` with the longest sequence of the call (fixed shapes size their buffers)."""

    def start(self, step: TargetStep) -> None:
        """Initialise the drafter's state from the prompt (after the target prefill)."""
        raise NotImplementedError

    def propose(
        self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """Propose up to K tokens per row after A (as many as the round's width policy asks): ``anchor_ids``
        ``[B]``, the last emitted token (the target has not processed it yet), at ``anchor_positions`` ``[B]``."""
        raise NotImplementedError

    def stage_plan(self) -> list[list[str]]:
        """``plan[k]``: the statistics stages a round verifying k candidates runs (what `widths.AutoWidth` prices)."""
        return [[]] * (self.num_candidates + 1)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit the positions the last verify accepted (accepted tokens + bonus); MTP work is timed as ``mtp``."""
        raise NotImplementedError

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> bool:
        """Keep only batch ``rows`` (finished sequences leave the batch); ``False`` if this drafter cannot."""
        return False

    def graph_calls(self) -> list:
        """The drafter's CUDA-graphed stages (`CUDAGraphCall`), for their counters (none by default)."""
        return []


class DrafterWrapper(Drafter):
    """Base for drafters that adjust another drafter's proposals (e.g. constrain or corrupt them for tests and
    benchmarks): everything but :meth:`propose` is forwarded to ``inner``."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        for name in ("name", "num_candidates", "needs_features", "needs_mtp_hidden", "hidden_input"):
            setattr(self, name, getattr(inner, name))

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

    def propose(self, anchor_ids, anchor_positions, select, stats) -> Proposal:
        """The inner drafter's proposal (override to change it)."""
        return self.inner.propose(anchor_ids, anchor_positions, select, stats)

    def stage_plan(self) -> list[list[str]]:
        """The inner drafter's."""
        return self.inner.stage_plan()

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> bool:
        """Forwarded to the inner drafter (override to also select the wrapper's own per-row state)."""
        return self.inner.select_rows(rows, rows_host)

    def graph_calls(self) -> list:
        """The inner drafter's graphed stages."""
        return self.inner.graph_calls()

    @property
    def width_policy(self):
        """The inner drafter's round width policy (set by the engine for ``verify_length``)."""
        return getattr(self.inner, "width_policy", None)

    @width_policy.setter
    def width_policy(self, policy) -> None:
        self.inner.width_policy = policy


class StatefulDrafter(Drafter):
    """The drafter state of the strategies below (an MTP state, a DFlash context, or both) and the round's width
    policy (``width_policy``, set by the engine for ``verify_length``; `widths.AllCandidates` by default)."""

    def __init__(self, fixed_shapes: bool, cuda_graphs: bool) -> None:
        self.fixed_shapes = fixed_shapes
        self.cuda_graphs = cuda_graphs
        self.width_policy: RoundWidth | None = None
        self.capacity: int | None = None  # slots per row with fixed shapes, set by `reserve`
        self.mtp: MTPState | None = None
        self.context: DFlashContext | None = None

    @property
    def widths(self) -> RoundWidth:
        """The round's width policy (every candidate when the engine set none)."""
        if self.width_policy is None:
            self.width_policy = AllCandidates(self.num_candidates, self.stage_plan())
        return self.width_policy

    def reserve(self, max_positions: int) -> None:
        """Size fixed shapes for sequences of up to ``max_positions`` tokens (plus one verify's candidates)."""
        if self.fixed_shapes and max_positions > MAX_FIXED_POSITIONS:
            # fixed shapes allocate the whole call's slots up front: a budget meant as "until EOS" would be an
            # allocation of that size, or an overflow
            raise ValueError(
                f"The fast path (dmtp_fast_path=True) reserves the draft's state for the whole call: {max_positions} "
                f"positions, more than the {MAX_FIXED_POSITIONS} it can hold. Set max_new_tokens (or max_length) to "
                "what the answer needs, or decode without the fast path, which grows its state as it goes."
            )
        self.capacity = max_positions + self.num_candidates + 1

    def _check_capacity(self, step: TargetStep) -> None:
        """Fixed shapes: refuse, before any write, a prompt the reserved capacity cannot hold with one verify."""
        if not self.fixed_shapes:
            return
        if self.capacity is None:
            raise ValueError("Fixed-shape drafter state needs its capacity first: call reserve(max_positions).")
        needed = step.width + self.num_candidates + 1
        if needed > self.capacity:
            raise ValueError(
                f"The prompt ({step.width} positions) and one verify need {needed} fixed slots per row, more than "
                f"the {self.capacity} reserved: reserve() the longest sequence of the call."
            )

    def _state(self, current, kind, model):
        """The state for this call: the previous one when its settings are unchanged (its buffers and captured
        graphs survive; `start` resets it in place), else a new one."""
        reusable = (
            current is not None and current.fixed_shapes == self.fixed_shapes and current.kv.limit == self.capacity
        )
        state = current if reusable else kind(model, self.fixed_shapes, self.cuda_graphs)
        state.kv.limit = self.capacity
        return state

    def _plain_round(self, anchor_ids: torch.Tensor) -> Proposal:
        """No candidates: the round is a plain decoding step."""
        return Proposal(anchor_ids.new_empty(anchor_ids.shape[0], 0), None)

    def _verified(self, tokens: torch.Tensor, scores: torch.Tensor) -> Proposal:
        """The drafted candidates cut to the width the policy chooses for this round."""
        width = self.widths.choose(tokens, scores)
        return Proposal(tokens[:, :width], scores[:, :width])

    def _flush_mtp(self, stats: SpecStats) -> None:
        """Feed the MTP head the pairs committed since it last ran (plain rounds only queue them)."""
        with stats.stage("mtp"), torch.no_grad():
            self.mtp.flush()

    def graph_calls(self) -> list:
        """Every captured stage of the state."""
        return [call for state in (self.mtp, self.context) if state is not None for call in state.graph_calls()]

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> bool:
        """Drop finished rows from every piece of state."""
        self.widths.select_rows(rows)
        for state in (self.mtp, self.context):
            if state is not None:
                state.select_rows(rows, rows_host)
        return True
