"""Which samples each process reads at each optimizer step: a pure function of ``(seed, step)``.

Anchors are also drawn per *global* batch from ``(seed, step)`` (`objective.anchor_scores`). Hence exact resume (no
data-loader state to restore) and a 2-process run equal to a 1-process run with the same global batch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["StepSchedule", "eval_batches", "rewarm_factor"]


class StepSchedule:
    """Deterministic data order: epoch ``e`` is a permutation seeded by ``seed + e``; step ``s`` takes the next
    ``global_batch_size`` samples (last partial batch dropped). Micro-batch ``m`` of process ``r`` reads global rows
    ``[(m * P + r) * b, ... + b)``, so any split of the same global batch reads the same samples in the same rows."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        accumulation_steps: int,
        num_processes: int = 1,
        process_index: int = 0,
        seed: int = 0,
    ):
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.accumulation_steps = accumulation_steps
        self.num_processes = num_processes
        self.process_index = process_index
        self.seed = seed
        self.global_batch_size = micro_batch_size * accumulation_steps * num_processes
        self.steps_per_epoch = num_samples // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"The training set has {num_samples} samples, fewer than one global batch ({self.global_batch_size} "
                f"= micro_batch_size x gradient_accumulation_steps x processes)."
            )
        self._epoch, self._order = -1, None

    def micro_batches(self, step: int) -> list[tuple[list[int], int]]:
        """This process's micro-batches at ``step``: ``(sample indices, first global row)`` each."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_samples, generator=generator).tolist()
        batch = self._order[k * self.global_batch_size : (k + 1) * self.global_batch_size]
        out = []
        for m in range(self.accumulation_steps):
            row = (m * self.num_processes + self.process_index) * self.micro_batch_size
            out.append((batch[row : row + self.micro_batch_size], row))
        return out


def eval_batches(num_batches: int, num_processes: int, process_index: int) -> list[tuple[int, bool]]:
    """``(batch index, real)`` for one process: batches ``b % P == r``, then dummy repeats of batch 0 (their outputs
    dropped) so that every process runs the same number of forwards. FSDP and ZeRO-3 gather weights inside every
    forward: uneven counts would leave a process waiting forever."""
    per_process = math.ceil(num_batches / num_processes)
    indices = [i * num_processes + process_index for i in range(per_process)]
    return [(b, True) if b < num_batches else (0, False) for b in indices]


def rewarm_factor(step: int, rewarm_from: int | None, rewarm_steps: int) -> float | None:
    """The factor on the scheduled learning rate at ``step`` after a weights-only resume at ``rewarm_from`` (fresh
    AdamW moments): a linear ramp over ``rewarm_steps`` steps; None when no ramp applies (the schedule as it is)."""
    if rewarm_from is None or step >= rewarm_from + rewarm_steps:
        return None
    return (step - rewarm_from + 1) / (rewarm_steps + 1)
