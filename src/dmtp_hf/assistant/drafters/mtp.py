"""Native MTP-k: the target's own MTP head chained k times (k = 4 is the blog's MTP415)."""

from __future__ import annotations

import torch

from ...modeling.native_mtp.head import NativeMTPHead
from ..stats import SpecStats
from ..target.step import TargetStep
from .base import Proposal, StatefulDrafter, optional_stage
from .state import MTPState

__all__ = ["MTPDrafter"]


class MTPDrafter(StatefulDrafter):
    """Native MTP-k: the target's MTP head chained k times (k = 4 is the blog's MTP415)."""

    needs_mtp_hidden = True

    def __init__(
        self, mtp_head: NativeMTPHead, num_steps: int = 1, *, fixed_shapes: bool = False, cuda_graphs: bool = True
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        super().__init__(fixed_shapes, cuda_graphs)
        self.head = mtp_head
        self.hidden_input = mtp_head.hidden_input
        self.num_candidates = num_steps
        self.name = f"mtp{num_steps}"

    def start(self, step: TargetStep) -> None:
        """Start the MTP state over all prompt pairs."""
        self._check_capacity(step)
        self.mtp = self._state(self.mtp, MTPState, self.head)
        with torch.no_grad():
            self.mtp.start(step)

    def stage_plan(self) -> list[list[str]]:
        """A width-k round runs T1 and k - 1 chained steps."""
        return [[]] + [["t1"] + ["mtp_step"] * (k - 1) for k in range(1, self.num_candidates + 1)]

    def propose(self, anchor_ids, anchor_positions, select, stats) -> Proposal:
        """Chain the MTP layer up to k times, while the width policy wants more; each step's token is selected
        with the processors and the tokens before it."""
        if not self.widths.begin_round(anchor_ids.shape[0]):
            return self._plain_round(anchor_ids)
        self._flush_mtp(stats)
        chosen: list[torch.Tensor] = []  # [B] per step
        scores: list[torch.Tensor] = []  # [B, V] per step

        def select_step(logits: torch.Tensor) -> torch.Tensor:
            token, score = select(logits[:, None], torch.stack(chosen, dim=1) if chosen else None)
            chosen.append(token[:, 0])
            scores.append(score[:, 0])
            return token[:, 0]

        def further(steps: int) -> bool:
            return self.widths.draft_further(torch.stack(chosen, dim=1), torch.stack(scores, dim=1))

        with torch.no_grad():
            self.mtp.propose(self.num_candidates, select_step, further, stage=stats.stage)
        return self._verified(torch.stack(chosen, dim=1), torch.stack(scores, dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Queue the accepted pairs for the MTP state (fed at the next drafting round)."""
        self.widths.learn(step.num_valid)
        with optional_stage(stats, "mtp"), torch.no_grad():
            self.mtp.advance(step)
