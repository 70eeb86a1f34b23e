"""The machine timings run on: how many cores are free, and a bounded CPU burner to measure under load.

Timings on a shared CPU depend on what else runs. Intra-op threads that outnumber the free cores make every method
crawl (each parallel region waits for its slowest thread, and that one waits for a core), so demos and benchmarks
pick their thread count from the cores actually free. `set_threads` does that for any program, and
speculative `generate` checks once per process (`thread_oversubscription_once`) that the threads it runs on do not
outnumber the free cores. `Burner` keeps some cores busy for the length of a measurement,
so a table "with a burner on one core" means the same thing on every machine; it never outlives its ``with`` block
(each burner process also stops by itself when its parent dies, or after ``max_seconds``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

__all__ = ["Burner", "free_cores", "set_threads", "thread_oversubscription_once"]


def free_cores(load: float | None = None, window: float = 0.5) -> int:
    """Cores not busy with other work: the cores this process may use less the cores busy now, at least 1.

    "Busy now" is measured over ``window`` seconds from ``/proc/stat`` (Linux), so a run that just ended does not
    count (the one-minute load average remembers it for minutes); elsewhere the load average. ``load`` overrides
    the measurement.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        load = _busy_cores(window)
    return max(1, min(cores, round(cores - load)))


# Whether this process's threads were checked (or chosen by `set_threads`): generate checks once per process, so
# that only its first call pays the short measurement.
_threads_checked = False
_threads_lock = threading.Lock()


def set_threads(threads: int | None = None, reserved: int = 0) -> int:
    """Set torch's intra-op threads to ``threads``, else to the cores free now less ``reserved`` (at least 1), as
    ``dmtp demo``, ``dmtp eval`` and ``dmtp bench`` do; returns the count. A count chosen here is not warned about
    by speculative ``generate`` (`thread_oversubscription_once`)."""
    global _threads_checked
    import torch  # here, not at the top: the `dmtp` parser imports nothing heavy

    chosen = threads or max(1, free_cores() - reserved)
    torch.set_num_threads(chosen)
    with _threads_lock:
        _threads_checked = True
    return chosen


def thread_oversubscription_once(threads: int, window: float = 0.2) -> str | None:
    """The first time in a process: a warning text when ``threads`` intra-op threads outnumber the cores free now
    (measured over ``window`` seconds), else None; None on every later call and after `set_threads`.

    Each parallel region waits for its slowest thread, and a thread without a core waits for one: on a loaded
    machine a verify over K + 1 tokens slows down far more than a one-token decoding step, so speculative decoding
    falls below plain decoding (0.40x plain with 2 threads, 1.8x with 1, on a 2-core machine with one core busy).
    """
    global _threads_checked
    with _threads_lock:
        if _threads_checked:
            return None
        _threads_checked = True
    if threads <= 1:  # never more than the one free core there always is
        return None
    free = free_cores(window=window)
    if threads <= free:
        return None
    return (
        f"torch runs {threads} intra-op threads, but only {free} core{'s' if free != 1 else ''} of this machine "
        f"{'are' if free != 1 else 'is'} free: speculative decoding loses most of its speedup (or runs slower than "
        f"plain generate) when its threads wait for cores. Set the threads before generating: "
        f"torch.set_num_threads({free}), or dmtp_hf.machine.set_threads() (the cores free then, as `dmtp demo` "
        "does). Checked once per process."
    )


def _busy_cores(window: float) -> float:
    """Cores' worth of CPU time spent busy over the next ``window`` seconds, machine-wide."""
    first = _cpu_times()
    if first is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(window)
    second = _cpu_times()
    busy = second[0] - first[0]
    total = second[1] - first[1]
    cpus = os.cpu_count() or 1
    return cpus * busy / total if total > 0 else 0.0


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _burn(deadline: float, parent: int, started, active) -> None:
    started.set()
    x = 0
    # until the deadline, and never past its parent: a parent killed by a signal cannot stop its children itself
    while time.monotonic() < deadline and os.getppid() == parent:
        if not active.wait(timeout=1.0):  # switched off: idle until switched on again
            continue
        for _ in range(10_000):  # pure-Python arithmetic: one core busy, no memory traffic to speak of
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


class Burner:
    """``with Burner(cores):`` keeps ``cores`` processes spinning on the CPU for the block (0: nothing);
    ``period=S``: on for S seconds, off for S seconds, in turn (a load that changes during a measurement)."""

    def __init__(self, cores: int, max_seconds: float = 4 * 3600, period: float | None = None) -> None:
        if cores < 0:
            raise ValueError(f"a burner needs a number of cores >= 0, got {cores}")
        if period is not None and period <= 0:
            raise ValueError(f"a burner's period must be > 0 seconds, got {period}")
        self.cores = cores
        self.max_seconds = max_seconds
        self.period = period
        self.processes: list[multiprocessing.Process] = []
        self.active = None  # set while the burner burns (a shared event its processes read)
        self._switch: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> Burner:
        deadline = time.monotonic() + self.max_seconds
        context = multiprocessing.get_context("spawn")  # no copy of a loaded model, no inherited threads
        started = [context.Event() for _ in range(self.cores)]
        self.active = context.Event()
        self.active.set()
        self.processes = [
            context.Process(target=_burn, args=(deadline, os.getpid(), event, self.active), daemon=True)
            for event in started
        ]
        for process in self.processes:
            process.start()
        # a spawned child takes a moment to import: whatever measures the free cores next must see it burning
        for event in started:
            event.wait(timeout=30)
        if self.period is not None and self.processes:
            self._stop.clear()
            self._switch = threading.Thread(target=self._alternate, daemon=True)
            self._switch.start()
        return self

    def _alternate(self) -> None:
        while not self._stop.wait(self.period):
            if self.active.is_set():
                self.active.clear()
            else:
                self.active.set()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._switch is not None:
            self._switch.join(timeout=10)
            self._switch = None
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join(timeout=10)
        self.processes = []
