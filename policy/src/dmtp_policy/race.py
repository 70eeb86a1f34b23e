"""Drafting against plain steps by the clock: the engine's backstop for what no estimate sees.

`RequestPolicy` chooses widths from estimates, and its `guard.GuardRail` judges drafted steps against plain steps as
the cost curve prices them. Both can be wrong together where an engine's plain step is rarely measured (a policy
that drafts every step measures a plain step once in a while, at whatever load the machine had then) or where time
goes somewhere neither prices (probes that verify nothing, steps the curve does not learn from). `PlainRace` prices
nothing: it adds up the wall time and the committed tokens of every step, in windows of the policy's free choice
and in short windows of forced plain steps run next to them, per batch-size bucket, and compares the two rates.
When free windows commit fewer tokens per second than plain windows next to them, the engine decodes plainly and
tries a free window again after a wait that doubles while drafting keeps losing.

What it costs: a plain window of `PLAIN_WINDOW` steps after every few free windows (`REFRESH_WINDOWS`: more of
them the more drafting wins), so about one percent of a clear win, and while drafting loses, one free window per
wait. No clock is read here: the engine passes seconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["FREE_WINDOW", "PLAIN_WINDOW", "PlainRace", "free_window"]

# Steps of a free window (the policy's own choice) at one request: enough that acceptance noise averages out over a
# few rounds. A batch of B requests sees B rounds a step, so its windows are shorter (`free_window`: over B to the
# BATCH_EXPONENT, down to MIN_FREE_WINDOW steps): a window that loses costs B requests at once. Not over the square
# root: a window must also outlast swings of the machine's load, which do not shrink with the batch (simulated in
# tests/test_policy.py: 0.5 lost to prompt lookup alone under a swinging load at 4 requests, 0.35 did not).
FREE_WINDOW = 32
MIN_FREE_WINDOW = 8
BATCH_EXPONENT = 0.35
# Steps of a plain window: plain steps vary little, a few measure their rate at the load of the moment.
PLAIN_WINDOW = 6
# Free windows judged against one plain window before the plain rate is measured again (the load moves): few
# where drafting wins by little (a small change of load could turn it), many where it wins clearly (each plain
# window forgoes the win): (the least ratio of free to plain rates, windows) from the closest to the clearest.
REFRESH_WINDOWS = ((1.1, 1), (1.3, 3), (float("inf"), 8))
# Free windows lose below the plain rate x (1 - MARGIN): acceptance noise within a window must not stop a draft
# that wins by a little.
MARGIN = 0.03
# Plain steps while backing off before a free window tries drafting again: the first wait, doubling while free
# windows keep losing, up to the longest.
FIRST_WAIT = 64
MAX_WAIT = 1024
# While backing off, a free window is a probe: half as long, it costs less when drafting still loses.
PROBE_SHARE = 0.5


def free_window(batch: int, probing: bool = False) -> int:
    """Steps of a free window of ``batch`` requests: `FREE_WINDOW` over ``batch ** BATCH_EXPONENT`` (acceptance noise
    falls with the rounds a window sees), at least `MIN_FREE_WINDOW`; half that for a probe while backing off."""
    steps = max(MIN_FREE_WINDOW, round(FREE_WINDOW / batch**BATCH_EXPONENT))
    return max(MIN_FREE_WINDOW // 2, round(steps * PROBE_SHARE)) if probing else steps


@dataclass
class _Window:
    """Steps of one mode in one bucket: tokens committed per request, and seconds."""

    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens_per_request: float, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens_per_request
        self.seconds += seconds

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


class PlainRace:
    """Free windows against plain windows by the clock (module docstring). Per step: `plain_now` (must the next
    step be plain?), then `step` once its wall time and committed tokens are known. Rates are per request (tokens a
    step commits over its batch size) so that the batch sizes of one bucket compare."""

    def __init__(self) -> None:
        self.bucket: int | None = None  # the bucket the open windows belong to (a change of bucket restarts them)
        self.free = _Window()
        self.plain = _Window()
        self.plain_rate: float | None = None  # the last plain window's rate in this bucket
        self.judged_since_plain = 0  # free windows judged against that rate
        self.refresh = 1  # ... before a plain window measures it again (`REFRESH_WINDOWS`)
        self.backing_off = False
        self.wait = FIRST_WAIT  # plain steps before the next free window while backing off
        self.waited = 0
        self.backoffs = 0
        self.ratios: deque[float] = deque(maxlen=64)  # recent judged free windows' rates over the plain rate

    def plain_now(self, bucket: int) -> bool:
        """Whether the next step of a batch in ``bucket`` must verify nothing: a plain window is measuring, or
        drafting lost and its wait has not run out."""
        if bucket != self.bucket:  # another batch size: what was measured for the last one says nothing here
            self._restart(bucket)
        if self.plain_rate is None:
            return True
        if self.backing_off:
            return self.waited < self.wait
        return self.judged_since_plain >= self.refresh

    def step(self, bucket: int, batch: int, plain: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch`` requests (in ``bucket``) ran, ``plain`` as this race forced it, and committed
        ``tokens`` in ``seconds`` (its wall time, drafting stages included)."""
        if bucket != self.bucket:
            self._restart(bucket)
            return
        if plain:  # plain windows of PLAIN_WINDOW steps, back to back while backing off: the latest rate counts
            self.waited += 1
            self.plain.add(tokens / batch, seconds)
            if self.plain.steps >= PLAIN_WINDOW:
                self.plain_rate, self.plain = self.plain.rate, _Window()
                self.judged_since_plain = 0
            return
        self.plain = _Window()  # a plain window cut short by free steps measures nothing
        self.free.add(tokens / batch, seconds)
        if self.free.steps < free_window(batch, self.backing_off) or self.plain_rate is None:
            return
        ratio = self.free.rate / self.plain_rate
        self.ratios.append(ratio)
        self.free = _Window()
        self.judged_since_plain += 1
        self.refresh = next(windows for below, windows in REFRESH_WINDOWS if ratio < below)
        if ratio >= 1 - MARGIN:
            self.backing_off, self.wait = False, FIRST_WAIT
            return
        if self.backing_off:
            self.wait = min(2 * self.wait, MAX_WAIT)
        else:
            self.backing_off, self.wait = True, FIRST_WAIT
            self.backoffs += 1
        self.waited = 0

    def _restart(self, bucket: int) -> None:
        self.bucket = bucket
        self.free, self.plain = _Window(), _Window()
        self.plain_rate = None
        self.judged_since_plain = 0
        self.refresh = 1
        self.waited = 0  # a back-off carries over (with its wait): drafting lost at the last batch size too
