"""Drafting strategies on one engine: ``dmtp`` (MTP T1 + DFlash T2..T7), ``dflash`` (7 DFlash proposals) and
``mtp`` (native MTP chained k steps). They share every other line of the decoding loop, so comparisons between
them differ only in how candidates are proposed.

A drafter sees the target only through :class:`TargetStep` (tokens, hidden states and context features of
positions the target has just committed) and returns a :class:`Proposal` per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicCache

from ..modeling.modeling_dmtp import DMTPDraftModel
from .stats import SpecStats
from .verification import process_logits, select_tokens


@dataclass
class TargetStep:
    """What the target just committed, handed to drafters after prefill and after each verify.

    For the ``n`` new positions ``t = start .. start + n - 1``: ``next_tokens[:, i]`` = ``x_{t+1}`` (the token that
    followed position t), ``mtp_hidden[:, i]`` = ``h_t`` as the MTP head reads it (post-norm by default), and
    ``features[:, i]`` = the DFlash context features of position t (target layers concatenated).
    """

    start: int
    next_tokens: torch.Tensor  # [B, n]
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

    def target_layer_ids(self) -> list[int]:
        """Target layers whose outputs form the context features (empty if unused)."""
        return []

    def start(self, step: TargetStep) -> None:
        """Initialise the drafter's state from the prompt (after the target prefill)."""
        raise NotImplementedError

    def propose(self, sequence: torch.Tensor, select: TokenSelector, stats: SpecStats) -> Proposal:
        """Propose ``num_candidates`` tokens after ``sequence`` (whose last token A the target has not seen)."""
        raise NotImplementedError

    def advance(self, step: TargetStep) -> None:
        """Commit the positions the last verify accepted (accepted tokens + bonus)."""
        raise NotImplementedError


class _DFlashContext:
    """The DFlash draft's context: cached context K/V plus target features not yet fed to the draft."""

    def __init__(self, draft: DMTPDraftModel) -> None:
        self.draft = draft
        self.cache = DynamicCache()
        self.pending: torch.Tensor | None = None  # [B, c, k*H] features of positions not yet in the cache
        self.pending_start = 0

    def add(self, step: TargetStep) -> None:
        if self.pending is None:
            self.pending, self.pending_start = step.features, step.start
        else:
            self.pending = torch.cat([self.pending, step.features], dim=1)

    def run_block(self, block_embeds: torch.Tensor, anchor_position: int) -> torch.Tensor:
        """One draft forward over the block; returns the final-normed block hidden ``[B, Q, H]``."""
        cached = self.cache.get_seq_length()
        new = 0 if self.pending is None else self.pending.shape[1]
        block_positions = self.draft.block_position_ids(torch.tensor([anchor_position], device=block_embeds.device))
        positions = torch.cat(
            [torch.arange(cached, cached + new, device=block_embeds.device)[None], block_positions], dim=1
        ).expand(block_embeds.shape[0], -1)
        hidden = self.draft(block_embeds, self.pending, positions, cache=self.cache).last_hidden_state
        self.pending = None
        return hidden


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

    def propose(self, sequence: torch.Tensor, select: TokenSelector, stats: SpecStats) -> Proposal:
        """``[A, MASK x K]`` -> K candidates."""
        with stats.stage("dflash"):
            block = self.draft.block_embeddings(sequence[:, -1])
            hidden = self.context.run_block(block, sequence.shape[1] - 1)
            logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
            tokens, scores = select(logits, sequence)
        return Proposal(tokens, scores)

    def advance(self, step: TargetStep) -> None:
        """Queue the accepted positions' features."""
        self.context.add(step)


class MTPDrafter(Drafter):
    """Native MTP-k: the target's MTP head chained k times (k = 4 is the blog's MTP415)."""

    name = "mtp"
    needs_mtp_hidden = True

    def __init__(self, mtp_head, num_steps: int = 1) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.mtp = mtp_head
        self.num_candidates = num_steps
        self.name = f"mtp{num_steps}"

    @property
    def hidden_input(self) -> str:
        """Which target hidden the MTP head reads ('post_norm' or 'pre_norm')."""
        return self.mtp.hidden_input

    def start(self, step: TargetStep) -> None:
        """Prefill the MTP head over all prompt pairs."""
        self.mtp.prefill(step.next_tokens, step.mtp_hidden, step.start)

    def propose(self, sequence: torch.Tensor, select: TokenSelector, stats: SpecStats) -> Proposal:
        """Chain the MTP layer k times; each step is selected with the processors and the prefix it extends."""
        chosen: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []

        def select_step(logits: torch.Tensor) -> torch.Tensor:
            prefix = torch.cat([sequence, *[t[:, None] for t in chosen]], dim=1)
            token, score = select(logits[:, None], prefix)
            chosen.append(token[:, 0])
            scores.append(score[:, 0])
            return token[:, 0]

        with stats.stage("mtp"):
            tokens, _ = self.mtp.propose(self.num_candidates, select_step)
        return Proposal(tokens, torch.stack(scores, dim=1))

    def advance(self, step: TargetStep) -> None:
        """Commit the accepted pairs to the MTP cache."""
        with torch.no_grad():
            self.mtp.advance(step.next_tokens, step.mtp_hidden, step.start)


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
            self.mtp.prefill(step.next_tokens, step.mtp_hidden, step.start)

    def propose(self, sequence: torch.Tensor, select: TokenSelector, stats: SpecStats) -> Proposal:
        """T1 from the cached MTP hidden, fusion, one DFlash forward for T2..T7."""
        with stats.stage("t1_fusion"):
            t1_logits, mtp_hidden = self.mtp.predict()  # the MTP hidden that predicts T1
            t1, t1_scores = select(t1_logits[:, None], sequence)
            block = self.draft.block_embeddings(sequence[:, -1], t1[:, 0], mtp_hidden)
        with stats.stage("dflash"):
            hidden = self.context.run_block(block, sequence.shape[1] - 1)
            logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
            rest, rest_scores = select(logits, torch.cat([sequence, t1], dim=1))
        return Proposal(torch.cat([t1, rest], dim=1), torch.cat([t1_scores, rest_scores], dim=1))

    def advance(self, step: TargetStep) -> None:
        """Commit accepted pairs to the MTP cache (its next ``g`` predicts the next T1); queue DFlash context."""
        self.context.add(step)
        with torch.no_grad():
            self.mtp.advance(step.next_tokens, step.mtp_hidden, step.start)
