"""Drafting strategies on one engine: ``dmtp`` (MTP T1 + DFlash T2..T7), ``dflash`` (7 DFlash proposals) and
``mtp`` (native MTP chained k steps). They share every other line of the decoding loop, so comparisons between
them differ only in how candidates are proposed.

A drafter sees the target only through :class:`TargetStep` (tokens, hidden states and context features of
positions the target has just committed) and returns a :class:`Proposal` per round.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicCache

from ..modeling.modeling_dmtp import DMTPDraftModel
from .stats import SpecStats
from .verification import process_logits, select_tokens


def _pair_mask(step: TargetStep) -> torch.Tensor | None:
    """The MTP head's pair mask (``None`` when every pair is real, which keeps its fast unmasked path)."""
    if step.mask is None or bool(step.mask.all()):
        return None
    return step.mask.long()


def _stage(stats: SpecStats | None, name: str):
    return stats.stage(name) if stats is not None else contextlib.nullcontext()


@dataclass
class TargetStep:
    """What the target just committed, handed to drafters after prefill and after each verify.

    Entry i of row b is target position ``positions[b, i] = t``: ``next_tokens[b, i]`` = ``x_{t+1}`` (the token that
    followed position t), ``mtp_hidden[b, i]`` = ``h_t`` as the MTP head reads it (post-norm by default) and
    ``features[b, i]`` = the DFlash context features of position t. ``mask[b, i]`` says whether the entry is real:
    batched rows commit different numbers of tokens, and prompts may be left-padded (``None``: all real).
    """

    positions: torch.Tensor  # [B, n]
    next_tokens: torch.Tensor  # [B, n]
    mask: torch.Tensor | None  # [B, n] bool
    mtp_hidden: torch.Tensor | None  # [B, n, H]
    features: torch.Tensor | None  # [B, n, k*H]


@dataclass
class Proposal:
    """Candidates of one round and, for rejection sampling, the processed scores each was drawn from."""

    tokens: torch.Tensor  # [B, K]
    scores: torch.Tensor | None  # [B, K, V]


class TokenSelector:
    """Turns draft logits into candidates with the generation's logits processors, exactly as the target will.

    ``do_sample=False`` takes the argmax (greedy and ``match`` verification); ``True`` samples (``rejection``).
    """

    def __init__(self, logits_processor: LogitsProcessorList | None, do_sample: bool) -> None:
        self.logits_processor = logits_processor
        self.do_sample = do_sample

    def __call__(self, logits: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` ``[B, K, V]`` of K consecutive positions after ``prefix`` -> tokens ``[B, K]``, scores."""
        if not self.logits_processor:
            scores = logits.float()
            return select_tokens(scores, self.do_sample), scores
        # Processors may depend on the prefix (e.g. repetition penalty): slot i sees the i tokens chosen before it.
        tokens, scores = [], []
        for i in range(logits.shape[1]):
            seen = torch.cat([prefix, *[t[:, None] for t in tokens]], dim=1)
            step = process_logits(logits[:, i], seen, self.logits_processor)
            tokens.append(select_tokens(step, self.do_sample))
            scores.append(step)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)


class Drafter:
    """Base class of drafting strategies (see module docstring)."""

    name = "drafter"
    num_candidates: int
    needs_features = False  # whether the target must return DFlash context features
    needs_mtp_hidden = False  # whether the target must provide the MTP input hidden
    fixed_slots = False  # advance takes the verify's K + 1 slots with a validity mask (fast path, no host sync)

    def target_layer_ids(self) -> list[int]:
        """Target layers whose outputs form the context features (empty if unused)."""
        return []

    def reserve(self, max_positions: int) -> None:
        """Called before `start` with the longest sequence of the call (fixed-capacity drafters size their state)."""

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
    benchmarks): state handling (start/advance) and target requirements are forwarded to ``inner``; subclasses
    override :meth:`propose`."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.num_candidates = inner.num_candidates
        self.needs_features = inner.needs_features
        self.needs_mtp_hidden = inner.needs_mtp_hidden
        self.hidden_input = getattr(inner, "hidden_input", "post_norm")
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


class _DFlashContext:
    """The DFlash draft's context: cached context K/V plus target features not yet fed to the draft.

    Entries are appended in commit order with their own positions (RoPE) and validity: the block attends to every
    real context entry, so their order in the cache does not matter and padded entries are simply masked.
    """

    def __init__(self, draft: DMTPDraftModel) -> None:
        self.draft = draft
        self.cache = DynamicCache()
        self.pending: list[TargetStep] = []
        self.positions: torch.Tensor | None = None  # [B, C] positions of the cached entries
        self.mask: torch.Tensor | None = None  # [B, C] validity of the cached entries

    def add(self, step: TargetStep) -> None:
        """Queue the features of newly committed positions (fed to the draft with the next block)."""
        self.pending.append(step)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of the cache, the entry bookkeeping and any queued features."""
        self.cache.reorder_cache(rows)
        if self.positions is not None:
            self.positions, self.mask = self.positions[rows], self.mask[rows]
        self.pending = [
            TargetStep(
                *(
                    None if t is None else t[rows]
                    for t in (s.positions, s.next_tokens, s.mask, s.mtp_hidden, s.features)
                )
            )
            for s in self.pending
        ]

    def run_block(self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
        """One draft forward over the block; returns the final-normed block hidden ``[B, Q, H]``."""
        features = torch.cat([step.features for step in self.pending], dim=1) if self.pending else None
        new_positions = torch.cat([step.positions for step in self.pending], dim=1) if self.pending else None
        new_mask = (
            torch.cat(
                [
                    step.mask if step.mask is not None else torch.ones_like(step.positions, dtype=torch.bool)
                    for step in self.pending
                ],
                dim=1,
            )
            if self.pending
            else None
        )
        self.pending = []
        if new_positions is not None:
            self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], 1)
            self.mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], 1)
        block_positions = self.draft.block_position_ids(anchor_positions)
        positions = block_positions if new_positions is None else torch.cat([new_positions, block_positions], dim=1)
        return self.draft(
            block_embeds,
            features,
            positions,
            cache=self.cache,
            context_mask=self.mask,
            context_positions=self.positions,
        ).last_hidden_state


class DFlashDrafter(Drafter):
    """DFlash alone: block ``[A, MASK x K]``, all K candidates from one parallel forward."""

    name = "dflash"
    needs_features = True

    def __init__(self, draft: DMTPDraftModel) -> None:
        if draft.config.anchor_layout != "dflash":
            raise ValueError(
                "DFlashDrafter needs a draft with anchor_layout='dflash' "
                f"(got {draft.config.anchor_layout!r}); load it with anchor_layout='dflash'."
            )
        self.draft = draft
        self.num_candidates = draft.config.num_candidates
        self.context: _DFlashContext | None = None

    def target_layer_ids(self) -> list[int]:
        """The draft's feature layers."""
        return list(self.draft.config.target_layer_ids)

    def start(self, step: TargetStep) -> None:
        """Fresh context cache holding the prompt features."""
        self.context = _DFlashContext(self.draft)
        self.context.add(step)

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """``[A, MASK x K]`` -> K candidates."""
        with stats.stage("dflash"):
            block = self.draft.block_embeddings(prefix[:, -1])
            hidden = self.context.run_block(block, anchor_positions)
            logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
            tokens, scores = select(logits, prefix)
        return Proposal(tokens, scores)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Queue the accepted positions' features."""
        self.context.add(step)

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows from the DFlash context."""
        self.context.select_rows(rows)
        return True


class MTPDrafter(Drafter):
    """Native MTP-k: the target's MTP head chained k times (k = 4 is the blog's MTP415)."""

    name = "mtp"
    needs_mtp_hidden = True

    def __init__(self, mtp_head, num_steps: int = 1) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.mtp = mtp_head
        self.state = mtp_head  # holds the committed MTP state: the head itself (fast path: its fixed slots)
        self.num_candidates = num_steps
        self.name = f"mtp{num_steps}"

    @property
    def hidden_input(self) -> str:
        """Which target hidden the MTP head reads ('post_norm' or 'pre_norm')."""
        return self.mtp.hidden_input

    def start(self, step: TargetStep) -> None:
        """Prefill the MTP head over all prompt pairs."""
        with torch.no_grad():
            self.state.prefill(step.next_tokens, step.mtp_hidden, step.positions, _pair_mask(step))

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """Chain the MTP layer k times; each step is selected with the processors and the prefix it extends."""
        chosen: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []

        def select_step(logits: torch.Tensor) -> torch.Tensor:
            seen = torch.cat([prefix, *[t[:, None] for t in chosen]], dim=1)
            token, score = select(logits[:, None], seen)
            chosen.append(token[:, 0])
            scores.append(score[:, 0])
            return token[:, 0]

        with stats.stage("mtp"):
            tokens, _ = self.state.propose(self.num_candidates, select_step)
        return Proposal(tokens, torch.stack(scores, dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit the accepted pairs to the MTP cache."""
        with _stage(stats, "mtp"), torch.no_grad():
            self.state.advance(step.next_tokens, step.mtp_hidden, step.positions, _pair_mask(step))

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows from the MTP head's state."""
        self.state.select_rows(rows)
        return True


class DMTPDrafter(Drafter):
    """DMTP: the native MTP head proposes T1, the DFlash draft T2..T7 conditioned on T1 and its MTP hidden."""

    name = "dmtp"
    needs_features = True
    needs_mtp_hidden = True

    def __init__(self, draft: DMTPDraftModel, mtp_head) -> None:
        if draft.config.anchor_layout == "dflash":
            raise ValueError("DMTPDrafter needs anchor_layout 'single' or 'dual'; use DFlashDrafter for 'dflash'.")
        self.draft = draft
        self.mtp = mtp_head
        self.num_candidates = draft.config.num_candidates
        self.context: _DFlashContext | None = None

    @property
    def hidden_input(self) -> str:
        """Which target hidden the MTP head reads ('post_norm' or 'pre_norm')."""
        return self.mtp.hidden_input

    def target_layer_ids(self) -> list[int]:
        """The draft's feature layers."""
        return list(self.draft.config.target_layer_ids)

    def start(self, step: TargetStep) -> None:
        """Prefill the MTP head over the prompt pairs and queue the prompt features for DFlash."""
        self.context = _DFlashContext(self.draft)
        self.context.add(step)
        with torch.no_grad():
            self.mtp.prefill(step.next_tokens, step.mtp_hidden, step.positions, _pair_mask(step))

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """T1 from the cached MTP hidden, fusion, one DFlash forward for T2..T7."""
        with stats.stage("t1_fusion"):
            t1_logits, mtp_hidden = self.mtp.predict()  # the MTP hidden that predicts T1
            t1, t1_scores = select(t1_logits[:, None], prefix)
            block = self.draft.block_embeddings(prefix[:, -1], t1[:, 0], mtp_hidden)
        with stats.stage("dflash"):
            hidden = self.context.run_block(block, anchor_positions)
            logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
            rest, rest_scores = select(logits, torch.cat([prefix, t1], dim=1))
        return Proposal(torch.cat([t1, rest], dim=1), torch.cat([t1_scores, rest_scores], dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit accepted pairs to the MTP cache (its next ``g`` predicts the next T1); queue DFlash context."""
        self.context.add(step)
        with _stage(stats, "mtp"), torch.no_grad():
            self.mtp.advance(step.next_tokens, step.mtp_hidden, step.positions, _pair_mask(step))

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows from the MTP head and the DFlash context."""
        self.mtp.select_rows(rows)
        self.context.select_rows(rows)
        return True
