"""What an engine step costs as a function of the tokens it verifies, learned from the steps the engine runs.

A step over T tokens (``T = sum over requests of 1 + width``) costs the target's forward over them, sampling and
verification, the drafter's pass over them, and the engine's bookkeeping: everything between two steps. On a GPU
the curve is flat until the batch stops being memory-bound; on a CPU it rises from the first extra token. It is
never a constant here: `StepCosts` keeps a running estimate per T seen, relative to a load that every observation
moves (a machine whose load changes shifts the whole curve within a few steps, not only the T it happens to run).
Between the T seen the curve is linear; past the widest one it keeps the slope of the last segment; it never
decreases in T; a T not seen lately is left out while fresher ones describe the curve.

NumPy and the standard library (the vLLM plugin imports it).
"""

from __future__ import annotations

import numpy as np

from .acceptance import isotonic

__all__ = ["LEARNING_RATE", "ModeledCosts", "StepCosts"]

# How far one observation moves the load (every T's estimate) and its own T's estimate relative to the load.
LEARNING_RATE = 0.3
# A T not observed in this many observations is left out of the curve while two fresher ones remain: what a wide
# step cost when wide steps stopped paying is no news of what it costs now (the load follows; its slope may not).
STALE_AFTER = 128
# Observations a T's point weighs at most in the monotone fit (recent ones move the point itself).
MAX_WEIGHT = 16


class StepCosts:
    """Seconds of a step by the tokens it verifies (module docstring)."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}  # T -> seconds at load 1
        self.seen: dict[int, int] = {}  # T -> the observation that last updated it
        self.counts: dict[int, int] = {}  # T -> observations of it (what its point weighs in the monotone fit)
        self.load = 1.0  # observed / estimated seconds over recent steps of every T
        self.observations = 0
        self._curves: dict[int, np.ndarray] = {}  # max_tokens -> curve, until the next observation

    def observe(self, tokens: int, seconds: float) -> None:
        """A step over ``tokens`` tokens took ``seconds``: the load and that T's estimate move toward it."""
        self.observations += 1
        self._curves.clear()
        self.seen[tokens] = self.observations
        self.counts[tokens] = self.counts.get(tokens, 0) + 1
        previous = self.points.get(tokens)
        if previous is None:  # a new point: nothing to compare with but an extrapolation, no news of the load
            self.points[tokens] = seconds / self.load
            return
        self.load += LEARNING_RATE * (seconds / previous - self.load)
        self.points[tokens] = previous + LEARNING_RATE * (seconds / self.load - previous)

    def known(self, tokens: int) -> bool:
        """Whether a step over ``tokens`` tokens has been observed."""
        return tokens in self.points

    def fresh(self, tokens: int) -> bool:
        """Whether a step over ``tokens`` tokens was observed within the last `STALE_AFTER` observations."""
        return tokens in self.seen and self.observations - self.seen[tokens] < STALE_AFTER

    def widest_fresh(self) -> int:
        """The widest T observed lately (0: none)."""
        return max((t for t in self.points if self.fresh(t)), default=0)

    def seconds(self, tokens: int) -> float:
        """The estimate for one T (0.0 before any observation)."""
        if not self.points:
            return 0.0
        return float(self.curve(tokens)[tokens])

    def curve(self, max_tokens: int) -> np.ndarray:
        """``[max_tokens + 1]`` estimated seconds of a step over T = 0..max_tokens tokens (module docstring)."""
        if max_tokens not in self._curves:
            self._curves[max_tokens] = self._interpolate(max_tokens)
        return self._curves[max_tokens]

    def _interpolate(self, max_tokens: int) -> np.ndarray:
        grid = np.arange(max_tokens + 1, dtype=np.float64)
        if not self.points:
            return np.zeros(max_tokens + 1)
        anchor = min(self.points)  # the narrowest step (a plain one) anchors the curve, however old
        fresh = [t for t in self.points if t == anchor or self.observations - self.seen[t] < STALE_AFTER]
        xs = np.array(sorted(fresh if len(fresh) >= 2 else self.points), dtype=np.float64)
        values = [self.points[int(x)] for x in xs]
        weights = [min(self.counts.get(int(x), 1), MAX_WEIGHT) for x in xs]
        # never decreasing in T, fitted by weight: one unlucky measurement of a rarely seen T (a step slowed by
        # something else) is pooled with its well-measured neighbours instead of lifting every wider T
        ys = self.load * np.array(isotonic([v * w for v, w in zip(values, weights, strict=True)], weights))
        # linear between the T seen, the last segment's slope past the widest, the first value before the first
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        out = np.interp(grid, xs, ys)
        out = np.where(grid > xs[-1], ys[-1] + slope * (grid - xs[-1]), out)
        return np.maximum.accumulate(out)


class ModeledCosts:
    """What an engine tells the policy each step and drafter stage cost, in place of the clock: a step over T
    tokens costs ``fixed + per_token * T`` seconds, the stages ``t1`` and ``block`` their own constants.

    For tests and simulations, never for serving: with a modeled clock the policy's choices follow from what the
    draft's proposals are accepted alone, the same on every machine and under any load (a test of what the policy
    verifies cannot then fail because a shared machine was busy), and a CPU can play a device whose steps cost what
    a GPU's do. Written ``"fixed=0.02,per_token=0.0005,t1=0.001,block=0.002"``; a key left out costs nothing."""

    KEYS = ("fixed", "per_token", "t1", "block")

    def __init__(self, fixed: float, per_token: float = 0.0, t1: float = 0.0, block: float = 0.0) -> None:
        if fixed <= 0 or min(per_token, t1, block) < 0:
            raise ValueError(f"modeled costs need fixed > 0 and no negative cost, got {fixed, per_token, t1, block}")
        self.fixed, self.per_token = fixed, per_token
        self.stages = {"t1": t1, "block": block}

    @classmethod
    def parse(cls, text: str) -> ModeledCosts:
        """``"key=seconds,..."`` with keys from `KEYS` (``fixed`` required)."""
        values: dict[str, float] = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in cls.KEYS or key in values:
                raise ValueError(f"modeled costs take each of {cls.KEYS} at most once as key=seconds, got {text!r}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"modeled cost {key!r} is not a number of seconds: {value!r}") from None
        if "fixed" not in values:
            raise ValueError(f"modeled costs need fixed=<seconds>, got {text!r}")
        return cls(**values)

    def step(self, tokens: int) -> float:
        """Seconds of a step over ``tokens`` tokens."""
        return self.fixed + self.per_token * tokens

    def stage(self, name: str) -> float:
        """Seconds of a drafter stage (``"t1"``, ``"block"``)."""
        return self.stages[name]
