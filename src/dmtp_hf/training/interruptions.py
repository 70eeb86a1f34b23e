"""Stopping a training run without losing it: SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) finish the
current step, save a resumable checkpoint and end the run with `TrainingInterrupted`; a second signal stops at once.
Every process stops at the same step (the request is all-reduced), so the checkpoint is consistent.
`terminal_interrupts_to_this_process` makes Ctrl-C in a terminal reach the trainer alone under ``accelerate launch``."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import torch

__all__ = ["GracefulStop", "TrainingInterrupted", "terminal_interrupts_to_this_process"]

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


# Set by accelerate's simple launcher (`accelerate launch --num_processes 1`, no torchrun) in its child's environment.
_SIMPLE_LAUNCHER_ENV = "ACCELERATE_USE_CPU"
# Set when the processes come from torchrun or MPI: several ranks, whose launcher forwards signals itself.
_MULTI_PROCESS_ENV = ("LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


@contextlib.contextmanager
def terminal_interrupts_to_this_process() -> Iterator[None]:
    """Under ``accelerate launch`` with one process, in a terminal: Ctrl-C reaches this process only.

    A terminal sends Ctrl-C's SIGINT to its whole foreground process group, the launcher included. accelerate's
    simple launcher waits for its child in ``Popen.wait`` under Python's default handler: it raised
    ``KeyboardInterrupt`` at once (a traceback, exit status 130) while this process was still saving its checkpoint,
    and no launch flag changes that. So, as a shell does for a job, this process moves to a process group of its own
    and makes it the terminal's foreground group for the run; Ctrl-C then stops training alone (checkpoint saved,
    exit 0), and the launcher, still waiting, exits 0 without a word. The terminal goes back to the launcher's group
    on the way out (if this process dies first, the shell takes it back when the launcher ends). Ctrl-Z is ignored
    meanwhile: it would stop this group only, which the shell does not watch, leaving the terminal to a stopped job.
    Anywhere else (no terminal, a background job, torchrun or MPI ranks, plain ``python``) nothing changes.
    """
    terminal = 0  # stdin: the launcher's child inherits it
    applies = (
        _SIMPLE_LAUNCHER_ENV in os.environ
        and not any(name in os.environ for name in _MULTI_PROCESS_ENV)
        and hasattr(os, "tcsetpgrp")  # POSIX job control
        and threading.current_thread() is threading.main_thread()  # signal handlers
    )
    try:
        launcher_group = os.getpgrp() if applies else None
        applies = applies and (
            os.isatty(terminal)
            and os.tcgetpgrp(terminal) == launcher_group  # a foreground job
            and os.getpgid(os.getppid()) == launcher_group  # the launcher shares the group (and would get Ctrl-C)
            and launcher_group != os.getpid()
        )
    except OSError:
        applies = False
    if not applies:
        yield
        return
    previous_stop = signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)
        _give_terminal_to(terminal, os.getpgrp())
    except OSError:  # left as it was: Ctrl-C reaches both, as without this
        with contextlib.suppress(OSError):
            os.setpgid(0, launcher_group)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            _give_terminal_to(terminal, launcher_group)
            os.setpgid(0, launcher_group)
        signal.signal(signal.SIGTSTP, previous_stop)


def _give_terminal_to(terminal: int, group: int) -> None:
    """``tcsetpgrp`` from a process that may be in a background group (SIGTTOU would stop it: blocked meanwhile)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(terminal, group)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
