"""Stopping a training run without losing it: SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) finish the
current step, save a resumable checkpoint and end the run with `TrainingInterrupted`; a second signal stops at once.
Every process stops at the same step (the request is all-reduced), so the checkpoint is consistent."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch

__all__ = ["GracefulStop", "TrainingInterrupted"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(RuntimeError):
    """The run stopped on a signal after saving a resumable checkpoint (rerun the same command to resume)."""

    def __init__(self, signal_name: str, step: int, checkpoint) -> None:
        super().__init__(
            f"{signal_name}: stopped at step {step}, resumable checkpoint in {checkpoint} (rerun the same command "
            "to continue)"
        )
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.exit_code = 128 + int(getattr(signal, signal_name, signal.SIGINT))


class GracefulStop:
    """Within the block, SIGINT/SIGTERM only request a stop (main thread only: elsewhere signals keep their
    handlers); `requested` says, for every process alike, whether one was."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.signal_name is not None:  # asked twice: stop now
            self.__exit__()
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(number).name

    def requested(self, accelerator) -> str | None:
        """The signal that asked to stop (on any process), or ``None``; one all-reduce of a flag."""
        flag = torch.tensor([self.signal_name == "SIGTERM", self.signal_name == "SIGINT"], dtype=torch.float32)
        flag = (
            accelerator.reduce(flag.to(accelerator.device), reduction="sum") if accelerator.num_processes > 1 else flag
        )
        if flag[0] > 0:
            return "SIGTERM"
        return "SIGINT" if flag[1] > 0 else None
