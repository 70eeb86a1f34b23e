"""The guard rail of ``verify_length="auto"``: what drafted rounds really commit per second, against plain steps.

`AutoWidth` chooses widths from estimates: acceptance per position and the cost of each width. Estimates can be
wrong in ways no estimate sees (a stage the cost model does not price, such as a hybrid target's rollback replay,
a machine whose load changes between the stages of a round). The guard does not estimate: it adds up what each
round cost (every stage the statistics' timer reports between two rounds) and what it committed, and compares the
drafted rounds of a recent window with plain decoding steps. When drafting has committed fewer tokens per second
than plain steps would have, the policy backs off to plain steps, and only its probes draft until one of them beats
plain steps again.

Plain steps are measured where the policy runs them (its plain rounds, per batch size); before any, a plain step
is priced by the cost model (its one-token verify, which follows the machine's load, plus the commit every round
pays; a plain step has nothing to roll back). Nothing here reads a clock: tests feed it synthetic seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = ["GuardRail", "GUARD_WINDOW"]

# Drafted rounds judged together: enough to average over the rounds where a draft is rejected early (a window of
# unlucky rounds must not stop a draft that wins), few enough that a loss stops within a second of decoding.
GUARD_WINDOW = 8
# Probes (drafted rounds while backing off) whose rate together must beat plain steps to resume drafting: one lucky
# probe is not enough where a round's acceptance is a coin toss.
PROBES_TO_RESUME = 2
# How fast measured plain steps move their running mean.
PLAIN_RATE = 0.3
# Stages that are not part of a round (the prompt's) and the outer wall time the round stages add up to, and the
# MTP head catching up on the pairs committed since it last ran: a cost of keeping the drafter's state, paid per
# committed token whatever the widths, which plain rounds only defer to the next drafted one (charged to that round,
# it would make every probe after a plain streak lose by the streak's length).
OUTSIDE_ROUNDS = frozenset({"prefill", "draft_prefill", "rounds", "mtp"})


class GuardRail:
    """Realised tokens per second of drafted rounds against plain steps over the last `GUARD_WINDOW` drafted
    rounds; ``backing_off`` says the policy should decode plainly (and draft only its probes)."""

    def __init__(self, window: int = GUARD_WINDOW, margin: float = 0.0, priced_per_round: bool = False) -> None:
        # drafting has lost when its rate falls below plain steps' x (1 - margin): a margin keeps the acceptance noise
        # of a window from stopping a draft that wins by little
        self.margin = margin
        # each round against plain steps as priced when it ran (not when the window closes): an engine whose plain
        # estimate follows the load step by step judges a window that straddles a change of load fairly
        self.priced_per_round = priced_per_round
        self.window_plain: float | None = None  # the plain rate the window closes with (priced_per_round off)
        # (tokens, what plain steps would have committed in the round's time) of recent drafted rounds
        self.drafted: deque[tuple[int, float]] = deque(maxlen=window)
        self.plain_seconds: dict[int, float] = {}  # batch size -> running mean of a measured plain round
        self.backing_off = False
        self.backoffs = 0  # times the guard stopped drafting
        self.windows: deque[float] = deque(maxlen=64)  # recent judged windows: what they committed over plain steps'
        self.probe_loss = 0.0  # seconds the last losing probe cost beyond the plain steps for its tokens
        # the open round: its batch size, width and committed tokens (once learned) and the seconds of its stages
        self.batch_size: int | None = None
        self.width: int | None = None
        self.tokens: int | None = None
        self.seconds = 0.0

    def stage(self, name: str, seconds: float) -> None:
        """A stage of the open round ended after ``seconds``."""
        if name in OUTSIDE_ROUNDS:
            return
        self.seconds += seconds

    def committed(self, width: int, tokens: int) -> None:
        """The open round verified ``width`` candidates per row and committed ``tokens`` over the batch."""
        self.width = width
        self.tokens = tokens

    def begin_round(self, batch_size: int, plain_step_seconds: Callable[[int], float]) -> None:
        """Close the previous round (judge it) and open one of ``batch_size`` rows. ``plain_step_seconds(B)``:
        the cost model's current estimate of a plain step at batch size B."""
        if self.tokens is not None and self.batch_size is not None and self.seconds > 0:
            self._close(plain_step_seconds)
        self.batch_size = batch_size
        self.width = None
        self.tokens = None
        self.seconds = 0.0

    def plain_rate(self, batch_size: int, plain_step_seconds: Callable[[int], float]) -> float:
        """Tokens per second of plain steps at ``batch_size``: measured, else estimated (see the module docstring)."""
        seconds = self.plain_seconds.get(batch_size)
        if seconds is None:
            seconds = plain_step_seconds(batch_size)
        return batch_size / seconds

    def _close(self, plain_step_seconds: Callable[[int], float]) -> None:
        if self.width == 0:
            self.plain_seconds[self.batch_size] = _mean(self.plain_seconds.get(self.batch_size), self.seconds)
            return
        plain = self.plain_rate(self.batch_size, plain_step_seconds) * (1 - self.margin)
        plain_tokens = self.seconds * plain  # what plain steps would have committed in the round's time
        if not self.priced_per_round:  # every round of the window against the plain rate it closes with
            plain_tokens = self.seconds
            self.window_plain = plain
        if self.backing_off:  # a probe: the probes since the back-off, together, must beat plain steps to end it
            self.probe_loss = max(self.seconds - self.tokens / plain, 0.0)
            self.drafted.append((self.tokens, plain_tokens))
            if len(self.drafted) >= PROBES_TO_RESUME and _won(self.drafted, self.window_plain):
                self.backing_off = False
            return
        self.drafted.append((self.tokens, plain_tokens))
        if len(self.drafted) == self.drafted.maxlen:  # judged once per window, not on every round of a sliding one
            won = _won(self.drafted, self.window_plain)
            self.windows.append(_ratio(self.drafted, self.window_plain))
            self.drafted.clear()  # the next window, or (backing off) the probes
            if not won:
                self.backing_off = True
                self.backoffs += 1


def _ratio(rounds, plain_rate: float | None = None) -> float:
    """Tokens drafted rounds committed over what plain steps would have (see `_won`)."""
    tokens = sum(t for t, _ in rounds)
    plain = sum(p for _, p in rounds)
    return tokens / max(plain if plain_rate is None else plain * plain_rate, 1e-12)


def _won(rounds, plain_rate: float | None = None) -> bool:
    """Whether drafted rounds committed at least what plain steps would have: ``rounds`` of ``(tokens, plain steps'
    tokens in the round's time)``, or with ``plain_rate`` of ``(tokens, seconds)``."""
    return _ratio(rounds, plain_rate) >= 1.0


def _mean(previous: float | None, value: float) -> float:
    return value if previous is None else previous + PLAIN_RATE * (value - previous)
