"""Which proposals a round verifies, given what each is expected to commit and what a step over T tokens costs.

Every engine step verifies, for each request b, ``w_b`` proposals (``w_b = 0``: a plain decoding step for that
request) in one target forward over ``T = sum_b (1 + w_b)`` tokens. Its expected yield is
``sum_b (1 + sum_{j < w_b} g[b, j])`` tokens, where ``g[b, j]`` is the probability that request b's proposal j is
accepted (`acceptance.gains`), non-increasing in j. The plan maximises tokens per second.

`allocate` does it exactly for any step cost that depends on T only: for a fixed T, the best yield takes the
``T - B`` largest gains of the whole batch, and because a row's gains never increase, the largest gains of a row are
its first ones: a width per row. Sorting the batch's gains once and scanning every T gives the optimum (one sort and
one cumulative sum, no loop over rows). A row whose proposals are fewer than K has ``-inf`` gains past them.

`choose_sources` picks, per row, which of several proposals (the draft's block, prompt lookup) to verify: the one
whose gains above the plan's marginal gain add up to more. `best_uniform_width` is the same question when every row
of a padded batch verifies one shared width (``generate``'s batches).

The arithmetic runs in NumPy on the host: a plan is a few dozen numbers, and an engine asks for several every step,
where each torch call would cost more than the arithmetic it does. Inputs may be torch tensors or arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Plan", "allocate", "as_array", "best_uniform_sources", "best_uniform_width", "choose_sources"]

TIE = 1e-6  # rates closer than this (relatively) are equal: rounding must not buy a verify that buys nothing


def as_array(values: Any) -> np.ndarray:
    """A host float64 array of a tensor (any device) or an array-like."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float64)


@dataclass
class Plan:
    """A step's widths and what the model expects of it."""

    widths: np.ndarray  # [B] proposals each row verifies
    tokens: float  # expected tokens committed over the batch
    seconds: float  # expected seconds of the step

    @property
    def rate(self) -> float:
        """Expected tokens per second."""
        return self.tokens / self.seconds

    @property
    def verified(self) -> int:
        """Proposals verified over the batch (T - B)."""
        return int(self.widths.sum())


def allocate(gains: Any, step_seconds: Any, drafted_seconds: float = 0.0) -> Plan:
    """The widths that maximise expected tokens per second.

    ``gains`` ``[B, K]``: probability that each row's proposal j is accepted (non-increasing along j; ``-inf`` where
    a row has no proposal). ``step_seconds`` ``[T_max + 1]``: seconds of a step over T tokens (T >= B; entries past
    its end cost as its last). ``drafted_seconds``: what a step pays besides when any proposal is verified.
    """
    gains = as_array(gains)
    curve = as_array(step_seconds)
    batch, k = gains.shape
    flat = gains.ravel()
    order = np.argsort(-flat, kind="stable")  # stable: a row's gains stay in order
    tokens = batch + np.concatenate([[0.0], np.cumsum(flat[order])])  # [B*K + 1]: yield of the m best proposals
    seconds = curve[np.minimum(batch + np.arange(batch * k + 1), curve.shape[0] - 1)]
    seconds[1:] += drafted_seconds
    with np.errstate(invalid="ignore"):
        rate = np.where(np.isfinite(tokens), tokens / seconds, -1.0)
    best = _first_best(rate)
    widths = np.bincount(order[:best] // k, minlength=batch)
    return Plan(widths, float(tokens[best]), float(seconds[best]))


def best_uniform_width(gains: Any, width_seconds: list[float]) -> int:
    """The one width (0..K) for every row with the most expected tokens per second; ``width_seconds[k]``: seconds of
    a round that verifies k proposals in every row."""
    gains = np.clip(as_array(gains), 0.0, None)
    cumulative = np.concatenate([np.zeros((gains.shape[0], 1)), np.cumsum(gains, axis=1)], axis=1)
    totals = (1 + cumulative).sum(axis=0)  # [K + 1] tokens for the batch at each width
    return _first_best(totals / np.asarray(width_seconds, dtype=np.float64))


def best_uniform_sources(gains: Any, width_seconds: list[float]) -> tuple[int, np.ndarray]:
    """One width w for every row of a padded batch and, per row, the source (axis 0 of ``gains`` ``[S, B, K]``)
    it verifies: for each w every row takes the source expected to commit more at w (``-inf`` gains count as
    nothing), and w maximises the batch's expected tokens per second (``width_seconds[w]``). ``(w, source [B])``."""
    gains = np.clip(np.nan_to_num(as_array(gains), neginf=0.0), 0.0, None)
    cumulative = np.concatenate([np.zeros(gains.shape[:2] + (1,)), np.cumsum(gains, axis=2)], axis=2)  # [S, B, K+1]
    best_per_row = cumulative.max(axis=0)  # [B, K + 1]
    width = _first_best((1 + best_per_row).sum(axis=0) / np.asarray(width_seconds, dtype=np.float64))
    return width, cumulative[:, :, width].argmax(axis=0)


def _first_best(rate: np.ndarray) -> int:
    """The first index whose rate equals the best within rounding: fewer proposals where more buy nothing."""
    return int(np.flatnonzero(rate >= rate.max() * (1 - TIE))[0])


def choose_sources(gains: Any, step_seconds: Any, drafted_seconds: float = 0.0) -> np.ndarray:
    """``[B]`` index of the source (axis 0 of ``gains`` ``[S, B, K]``) each row verifies.

    The marginal gain a proposal must reach to be worth its verify is read off the plan over the best of every
    source (per row and position: an optimistic bound); a row takes the source whose gains above that threshold sum
    to the most (ties: the first source)."""
    gains = as_array(gains)
    envelope = gains.max(axis=0)  # [B, K]
    plan = allocate(envelope, step_seconds, drafted_seconds)
    chosen = np.arange(envelope.shape[1])[None] < plan.widths[:, None]
    selected = envelope[chosen]
    threshold = float(selected.min()) if selected.size else max(float(envelope.max()), 0.0)
    value = np.nan_to_num(np.clip(gains - threshold, 0.0, None), nan=0.0).sum(axis=-1)  # [S, B]
    return value.argmax(axis=0)
