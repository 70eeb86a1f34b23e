"""Speculative-decoding statistics with exactly the definitions of docs/design.md (metrics) and the DMTP blog.

``hist[k]`` = verify rounds that accepted exactly k drafted candidates (k = 0..K).

- acceptance length per verify: ``1 + sum(k * hist[k]) / sum(hist)`` (includes the bonus token)
- acceptance length per request: mean over requests of (tokens committed by rounds / rounds)
- first-candidate acceptance: ``1 - hist[0] / sum(hist)``
- cumulative acceptance ``P(L >= k)`` and conditional ``P(L >= k | L >= k-1)``, k = 1..K
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

STAGES = ("prefill", "draft_prefill", "mtp", "t1", "mtp_step", "dflash", "verify", "rollback", "commit")
# Stages inside the decoding rounds: with synchronised timing they add up to the "rounds" stage.
ROUND_STAGES = ("mtp", "t1", "mtp_step", "dflash", "verify", "rollback", "commit")


@dataclass
class RequestStats:
    """Per-request (per-turn) counts: rounds, tokens committed by rounds, and the acceptance histogram."""

    num_candidates: int
    hist: list[int] = field(default_factory=list)
    rounds: int = 0
    round_tokens: int = 0  # tokens committed by verify rounds (accepted + bonus), clipped at EOS/length

    def __post_init__(self) -> None:
        if not self.hist:
            self.hist = [0] * (self.num_candidates + 1)

    def add_round(self, accepted: int, committed: int) -> None:
        """A verify round that accepted ``accepted`` candidates and committed ``committed`` tokens (bonus included,
        clipped at EOS or the length limit)."""
        self.rounds += 1
        self.hist[accepted] += 1
        self.round_tokens += committed

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verify round for this request (bonus included)."""
        return self.round_tokens / self.rounds if self.rounds else float("nan")


class SpecStats:
    """Aggregated statistics of one or many speculative ``generate`` calls (one entry per request/turn).

    Stage times are wall-clock seconds per stage: ``prefill`` (target), ``draft_prefill`` (MTP + DFlash state
    over the prompt), ``mtp`` (the MTP head over the pairs committed since it last ran), ``t1`` (the MTP head's
    T1 logits + selection), ``mtp_step`` (each further step of an MTP-k chain), ``dflash`` (T1's embedding +
    fusion, the parallel draft forward and its candidates), ``verify`` (target forward + acceptance), ``rollback``
    (target cache crop / restore + replay), ``commit`` (the round's bookkeeping and its one host sync); ``rounds``
    is the wall time of all rounds, which the round stages add up to. On CUDA every stage is synchronised with
    ``profile=True`` (``sync_device``), so the times are exact and add up.

    This is the engine's one timer: ``listener(name, seconds)``, when set (the round's width policy, for its cost
    model), hears every stage as it ends.
    """

    def __init__(self, num_candidates: int, strategy: str = "dmtp") -> None:
        self.num_candidates = num_candidates
        self.strategy = strategy
        self.requests: list[RequestStats] = []
        self.stage_seconds: dict[str, float] = defaultdict(float)
        # CUDA-graphed stages of the fast path: captures, replays and capture failures (each one also warned once)
        self.cuda_graphs: dict[str, Any] = {"captures": 0, "replays": 0, "failures": []}
        # verify_length="auto": rounds per chosen width, and rounds that ran no draft forward beyond T1
        self.verify_widths: dict[int, int] = defaultdict(int)
        self.skipped_drafts = 0
        self.plain_rounds = 0  # auto rounds that ran no drafter stage (drafting did not pay)
        self.sync_device: torch.device | None = None  # set by `profile=True`: every stage synchronises on CUDA
        self.listener: Callable[[str, float], None] | None = None  # hears every stage's seconds (see above)

    # -- recording -------------------------------------------------------------------------------------------------

    def new_request(self) -> RequestStats:
        """Start counting a new request (or MT-Bench turn)."""
        request = RequestStats(self.num_candidates)
        self.requests.append(request)
        return request

    @contextmanager
    def stage(self, name: str, sync_device: torch.device | None = None):
        """Time a stage (a ``dmtp::<name>`` range under ``torch.profiler``); with ``sync_device`` (or
        :attr:`sync_device`) on CUDA, synchronise so the time is exact."""
        sync_device = sync_device if sync_device is not None else self.sync_device
        if sync_device is not None and sync_device.type == "cuda":
            torch.cuda.synchronize(sync_device)
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"dmtp::{name}"):  # a labelled range under torch.profiler
                yield
        finally:
            if sync_device is not None and sync_device.type == "cuda":
                torch.cuda.synchronize(sync_device)
            seconds = time.perf_counter() - start
            self.stage_seconds[name] += seconds
            if self.listener is not None:
                self.listener(name, seconds)

    def record_widths(self, policy) -> None:
        """Add the widths an auto-width policy chose (and its skipped draft forwards) after a call."""
        for width in getattr(policy, "widths", ()):
            self.verify_widths[width] += 1
        self.skipped_drafts += getattr(policy, "skipped", 0)
        self.plain_rounds += getattr(policy, "plain", 0)

    def record_graphs(self, calls) -> None:
        """Add the counters of a drafter's graphed stages (`CUDAGraphCall`s) after a call."""
        self.cuda_graphs["captures"] += sum(c.captures for c in calls)
        self.cuda_graphs["replays"] += sum(c.replays for c in calls)
        self.cuda_graphs["failures"] += [c.failure for c in calls if c.failure]

    def merge(self, other: SpecStats) -> SpecStats:
        """Add another run's requests and stage times to this one (same candidate budget)."""
        if other.num_candidates != self.num_candidates:
            raise ValueError("cannot merge statistics with different candidate budgets")
        self.requests.extend(other.requests)
        for key, value in other.stage_seconds.items():
            self.stage_seconds[key] += value
        for key in ("captures", "replays"):
            self.cuda_graphs[key] += other.cuda_graphs[key]
        self.cuda_graphs["failures"] += other.cuda_graphs["failures"]
        for width, count in other.verify_widths.items():
            self.verify_widths[width] += count
        self.skipped_drafts += other.skipped_drafts
        self.plain_rounds += other.plain_rounds
        return self

    # -- metrics ---------------------------------------------------------------------------------------------------

    @property
    def hist(self) -> list[int]:
        """Acceptance histogram over all requests: ``hist[k]`` rounds accepted exactly k candidates."""
        total = [0] * (self.num_candidates + 1)
        for request in self.requests:
            for k, count in enumerate(request.hist):
                total[k] += count
        return total

    @property
    def num_rounds(self) -> int:
        """Total verify rounds."""
        return sum(self.hist)

    @property
    def acceptance_length_per_verify(self) -> float:
        """``1 + sum(k hist[k]) / sum(hist)``."""
        hist = self.hist
        rounds = sum(hist)
        return 1.0 + sum(k * c for k, c in enumerate(hist)) / rounds if rounds else float("nan")

    @property
    def acceptance_length_per_request(self) -> float:
        """Mean over requests of tokens committed per round."""
        values = [r.acceptance_length for r in self.requests if r.rounds]
        return sum(values) / len(values) if values else float("nan")

    @property
    def first_candidate_acceptance(self) -> float:
        """``1 - hist[0] / sum(hist)``: rounds whose first candidate was accepted."""
        hist = self.hist
        rounds = sum(hist)
        return 1.0 - hist[0] / rounds if rounds else float("nan")

    @property
    def cumulative_acceptance(self) -> list[float]:
        """``P(L >= k)`` for k = 1..K, over verify rounds."""
        hist = self.hist
        rounds = sum(hist)
        if not rounds:
            return [float("nan")] * self.num_candidates
        return [sum(hist[k:]) / rounds for k in range(1, self.num_candidates + 1)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """``P(L >= k | L >= k-1)`` for k = 1..K."""
        hist = self.hist
        out = []
        for k in range(1, self.num_candidates + 1):
            reached = sum(hist[k - 1 :])
            out.append(sum(hist[k:]) / reached if reached else float("nan"))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every metric plus the raw histogram and per-request counts (JSON-serialisable)."""
        return {
            "strategy": self.strategy,
            "num_candidates": self.num_candidates,
            "num_requests": len(self.requests),
            "num_rounds": self.num_rounds,
            "hist": self.hist,
            "acceptance_length_per_verify": self.acceptance_length_per_verify,
            "acceptance_length_per_request": self.acceptance_length_per_request,
            "first_candidate_acceptance": self.first_candidate_acceptance,
            "cumulative_acceptance": self.cumulative_acceptance,
            "conditional_acceptance": self.conditional_acceptance,
            "stage_seconds": dict(self.stage_seconds),
            "cuda_graphs": {**self.cuda_graphs, "failures": list(self.cuda_graphs["failures"])},
            "verify_widths": {str(k): v for k, v in sorted(self.verify_widths.items())},
            "skipped_drafts": self.skipped_drafts,
            "plain_rounds": self.plain_rounds,
            "requests": [{"rounds": r.rounds, "round_tokens": r.round_tokens, "hist": r.hist} for r in self.requests],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecStats:
        """Rebuild statistics from :meth:`to_dict` output (per-request counts and stage times), e.g. to merge saved
        evaluation results; every derived metric is recomputed from the requests."""
        stats = cls(int(data["num_candidates"]), data.get("strategy", "dmtp"))
        for entry in data.get("requests", []):
            request = stats.new_request()
            request.rounds = int(entry["rounds"])
            request.round_tokens = int(entry["round_tokens"])
            request.hist = [int(c) for c in entry["hist"]]
        for key, value in (data.get("stage_seconds") or {}).items():
            stats.stage_seconds[key] += float(value)
        graphs = data.get("cuda_graphs") or {}
        stats.cuda_graphs = {
            "captures": int(graphs.get("captures", 0)),
            "replays": int(graphs.get("replays", 0)),
            "failures": list(graphs.get("failures", [])),
        }
        for width, count in (data.get("verify_widths") or {}).items():
            stats.verify_widths[int(width)] += int(count)
        stats.skipped_drafts = int(data.get("skipped_drafts", 0))
        stats.plain_rounds = int(data.get("plain_rounds", 0))
        return stats

    def summary(self) -> str:
        """One human-readable line."""
        return (
            f"{self.strategy}: acceptance length {self.acceptance_length_per_verify:.3f}/verify, "
            f"{self.acceptance_length_per_request:.3f}/request, first-candidate acceptance "
            f"{100 * self.first_candidate_acceptance:.1f}% over {self.num_rounds} rounds"
        )
