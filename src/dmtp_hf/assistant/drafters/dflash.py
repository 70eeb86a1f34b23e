"""DFlash alone: the block ``[A, MASK x K]``, all K candidates from one parallel forward (DFlash2 too: its
backbone picks the candidates with its walk)."""

from __future__ import annotations

from ...modeling.modeling_dmtp import DMTPDraftModel
from ..stats import SpecStats
from ..target.step import TargetStep
from .base import Proposal, StatefulDrafter, block_candidates
from .state import DFlashContext

__all__ = ["DFlashDrafter"]


class DFlashDrafter(StatefulDrafter):
    """DFlash alone: block ``[A, MASK x K]``, all K candidates from one parallel forward."""

    name = "dflash"
    needs_features = True

    def __init__(self, draft: DMTPDraftModel, *, fixed_shapes: bool = False, cuda_graphs: bool = True) -> None:
        if draft.config.anchor_layout != "dflash":
            raise ValueError(
                "DFlashDrafter needs a draft with anchor_layout='dflash' "
                f"(got {draft.config.anchor_layout!r}); load it with anchor_layout='dflash'."
            )
        super().__init__(fixed_shapes, cuda_graphs)
        self.draft = draft
        self.num_candidates = draft.config.num_candidates

    def target_layer_ids(self) -> list[int]:
        """The draft's feature layers."""
        return list(self.draft.config.target_layer_ids)

    def start(self, step: TargetStep) -> None:
        """Fresh context holding the prompt features."""
        self._check_capacity(step)
        self.context = self._state(self.context, DFlashContext, self.draft)
        self.context.start(step)

    def stage_plan(self) -> list[list[str]]:
        """A round at any width runs the one block forward."""
        return [[]] + [["dflash"]] * self.num_candidates

    def propose(self, anchor_ids, anchor_positions, select, stats) -> Proposal:
        """``[A, MASK x K]`` -> K candidates from one parallel forward."""
        if not self.widths.begin_round(anchor_ids.shape[0]):
            return self._plain_round(anchor_ids)
        with stats.stage("dflash"):
            hidden, logits = self.context.block_outputs(self.draft.block_embeddings(anchor_ids), anchor_positions)
            tokens, scores = block_candidates(self.draft, hidden, logits, anchor_ids, select)
        return self._verified(tokens, scores)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Queue the accepted positions' features."""
        self.widths.learn(step.num_valid)
        self.context.add(step)
