"""DMTP: the target's native MTP head proposes T1; T1 and the MTP hidden state that predicted it are fused into the
block ``[A, T1 + fusion, MASK x 6]``, and one DFlash forward proposes T2..T7 (docs/design.md §2)."""

from __future__ import annotations

import torch

from ...modeling.modeling_dmtp import DMTPDraftModel
from ...modeling.native_mtp.head import NativeMTPHead
from ..stats import SpecStats
from ..target.step import TargetStep
from .base import Proposal, StatefulDrafter, block_candidates, optional_stage
from .state import DFlashContext, MTPState

__all__ = ["DMTPDrafter"]


class DMTPDrafter(StatefulDrafter):
    """DMTP: the native MTP head proposes T1, the DFlash draft T2..T7 conditioned on T1 and its MTP hidden."""

    name = "dmtp"
    needs_features = True
    needs_mtp_hidden = True

    def __init__(
        self, draft: DMTPDraftModel, mtp_head: NativeMTPHead, *, fixed_shapes: bool = False, cuda_graphs: bool = True
    ) -> None:
        if draft.config.anchor_layout == "dflash":
            raise ValueError("DMTPDrafter needs anchor_layout 'single' or 'dual'; use DFlashDrafter for 'dflash'.")
        super().__init__(fixed_shapes, cuda_graphs)
        self.draft = draft
        self.head = mtp_head
        self.hidden_input = mtp_head.hidden_input
        self.num_candidates = draft.config.num_candidates

    def target_layer_ids(self) -> list[int]:
        """The draft's feature layers."""
        return list(self.draft.config.target_layer_ids)

    def start(self, step: TargetStep) -> None:
        """Start the MTP state over the prompt pairs and queue the prompt features for DFlash."""
        self._check_capacity(step)
        self.mtp = self._state(self.mtp, MTPState, self.head)
        self.context = self._state(self.context, DFlashContext, self.draft)
        self.context.start(step)
        with torch.no_grad():
            self.mtp.start(step)

    def stage_plan(self) -> list[list[str]]:
        """T1 alone, or T1 and the DFlash block behind it."""
        return [[], ["t1"]] + [["t1", "dflash"]] * (self.num_candidates - 1)

    def propose(self, anchor_ids, anchor_positions, select, stats) -> Proposal:
        """T1 from the MTP head, fused into the block; one DFlash forward for T2..T7."""
        if not self.widths.begin_round(anchor_ids.shape[0]):
            return self._plain_round(anchor_ids)
        self._flush_mtp(stats)  # the pairs of earlier rounds, outside T1's timing (paid whatever the width)
        # 1. T1: the MTP head's token from g, the hidden state of the last committed pair (never one that saw T1)
        with stats.stage("t1"):
            t1_logits, mtp_hidden = self.mtp.predict()  # [B, V], [B, H]: the MTP hidden that predicted T1
            t1, t1_scores = select(t1_logits[:, None])  # [B, 1], [B, 1, V]
        if not self.widths.draft_further(t1, t1_scores):  # T1 alone is this round's best bet: no DFlash forward
            return self._verified(t1, t1_scores)
        with stats.stage("dflash"):
            # 2. Fuse: the block [A, T1 + fusion(T1, mtp_hidden), MASK x 6]
            block = self.draft.block_embeddings(anchor_ids, t1[:, 0], mtp_hidden)
            # 3. Block: one parallel forward over it, conditioned on the target's context features -> T2..T7
            hidden, logits = self.context.block_outputs(block, anchor_positions)
            rest, rest_scores = block_candidates(self.draft, hidden, logits, t1[:, 0], select, t1)
        return self._verified(torch.cat([t1, rest], dim=1), torch.cat([t1_scores, rest_scores], dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Commit accepted pairs to the MTP state (its next ``g`` predicts the next T1); queue DFlash context."""
        self.widths.learn(step.num_valid)
        self.context.add(step)
        with optional_stage(stats, "mtp"), torch.no_grad():
            self.mtp.advance(step)
