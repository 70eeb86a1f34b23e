"""What the trainer asks of whatever it trains: the draft objective (`objective.DMTPTrainingObjective`), the native
MTP head's (`mtp_objective.MTPHeadObjective`) or both at once (`mtp_objective.JointObjective`).

The trainer and the checkpoints never test an objective's type nor the config's ``train_mtp_head``: they ask the
`TrainingObjective` what it trains (`trained_modules`, `draft`, `trained_head`), what its loss is divided by
(`loss_normalizers`), and how its metric sums reduce over processes (`metric_vector`, `metrics_from_vector`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..modeling.modeling_dmtp import DMTPDraftModel

__all__ = ["StepOutput", "TrainingObjective", "unwrap_peft"]


def unwrap_peft(model: nn.Module | None) -> nn.Module | None:
    """The model inside a PEFT wrapper (LoRA layers are injected into it in place, so it trains through the
    wrapper's parameters), or ``model`` itself when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class StepOutput(Protocol):
    """The result of an objective on one micro-batch: the ``loss`` to backpropagate, and metric sums the objective
    itself reads back (`TrainingObjective.metric_vector`)."""

    loss: torch.Tensor


class TrainingObjective(nn.Module, ABC):
    """A trained model and its loss, as one module for accelerate to wrap (DDP/FSDP/DeepSpeed).

    The trainer sums `loss_normalizers` over the whole global batch before any forward and passes the totals back
    to ``forward`` by name, with the micro-batch's inputs; ``forward`` returns a `StepOutput`. A step's (or an
    evaluation's) outputs become one vector of sums (`metric_vector`), which all processes reduce, then metrics
    (`metrics_from_vector`).
    """

    @abstractmethod
    def trained_modules(self) -> dict[str, nn.Module]:
        """What this objective trains and a checkpoint saves, by part: ``"draft"`` and/or ``"mtp_head"``, each as
        trained (inside its PEFT wrapper when LoRA is on: `models.save_models` merges a copy)."""

    @abstractmethod
    def loss_normalizers(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Scalar weight totals of one micro-batch's loss terms, by the ``forward`` argument they go to; known from
        the inputs alone (anchors and loss masks), so the trainer knows the global totals before any forward."""

    @abstractmethod
    def metric_vector(self, outputs: Sequence[StepOutput]) -> torch.Tensor:
        """The summed metric sums of micro-batch outputs, as one vector (what processes all-reduce)."""

    @abstractmethod
    def empty_metric_vector(self, device: torch.device | str) -> torch.Tensor:
        """Zeros shaped like `metric_vector` (a process without an evaluation batch)."""

    @abstractmethod
    def metrics_from_vector(self, vector: torch.Tensor) -> dict[str, float]:
        """Named metrics from the (reduced) sums of `metric_vector`."""

    @property
    def draft(self) -> DMTPDraftModel | None:
        """The draft being trained, outside any PEFT wrapper; None when only the head is."""
        return unwrap_peft(self.trained_modules().get("draft"))

    @property
    def trained_head(self) -> nn.Module | None:
        """The MTP head being trained, as trained (PEFT-wrapped when LoRA is on); None when it is frozen."""
        return self.trained_modules().get("mtp_head")

    def part_weights(self, part: str, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights of ``part`` (a `trained_modules` key) under the part's own names, out of a state dict of this
        objective (gathered from shards under FSDP/DeepSpeed)."""
        module = self.trained_modules()[part]
        prefix = next(name for name, child in self.named_modules() if child is module) + "."
        return {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
