"""What a round's proposals are expected to commit: per-position acceptance, calibrated or learned.

A round that verifies k proposals of a row commits ``1 + sum_{j < k} g_j`` tokens in expectation, where
``g_j = prod_{i <= j} r_i`` is the probability that proposal j is accepted (every one before it was) and ``r_i`` the
probability that proposal i is accepted once the ones before it were. The ``r`` come from the proposer's own
confidence through a `Calibration` (fitted per position on recorded ``(confidence, accepted)`` pairs,
``dmtp calibrate``) or, without one, from what the rounds of that proposer accepted (`AcceptanceEstimate`: a
running mean per position, then a moving average, so the estimate follows the text).

Pure torch and the standard library: the vLLM plugin imports this package from vLLM's own environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "PRIOR_ACCEPTANCE",
    "PRIOR_RATE",
    "PRIOR_WEIGHT",
    "AcceptanceEstimate",
    "Calibration",
    "expected_commits",
    "gains",
    "isotonic",
]

# Before any evidence a proposal is assumed accepted this often (a calibrated draft: its calibration's held-out
# rate), worth this many observations: optimistic, so a new proposer is tried before it is judged. Later evidence
# moves the estimate with weight >= PRIOR_RATE.
PRIOR_ACCEPTANCE = 0.9
PRIOR_WEIGHT = 2.0
PRIOR_RATE = 0.1


def gains(rates: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` probability that proposal j is accepted (all before it were), from the conditional ``rates``."""
    return rates.float().cumprod(dim=-1)


def expected_commits(rates: torch.Tensor) -> torch.Tensor:
    """``[B, K + 1]`` tokens a row commits in expectation verifying k = 0..K proposals (the bonus token included)."""
    cumulative = gains(rates).cumsum(dim=-1)
    return 1 + torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative], dim=-1)


@dataclass
class Calibration:
    """Per proposal position j, a monotone step map confidence -> P(accepted | earlier accepted).

    ``edges`` are the right bin edges in ``(0, 1]``; ``rates[j][b]`` the fitted rate of bin b at position j;
    ``base_rates[j]`` the rate at position j over all confidences (where an estimate starts: a draft known to be weak
    is not tried in full first).
    """

    edges: list[float] = field(default_factory=list)
    rates: list[list[float]] = field(default_factory=list)
    base_rates: list[float] = field(default_factory=list)
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> (edges, rates)

    def __call__(self, conf: torch.Tensor) -> torch.Tensor:
        """``[B, k]`` acceptance probabilities of proposals with confidences ``conf`` ``[B, k]``."""
        if not self.rates:
            return conf.float()
        if conf.device not in self._tables:
            self._tables[conf.device] = (
                torch.tensor(self.edges, device=conf.device),
                torch.tensor(self.rates, device=conf.device),  # [K, bins]
            )
        edges, table = self._tables[conf.device]
        bins = torch.bucketize(conf.float().clamp(0, 1), edges).clamp(max=len(self.edges) - 1)  # [B, k]
        positions = torch.arange(conf.shape[1], device=conf.device).clamp(max=len(self.rates) - 1)
        return table[positions[None].expand_as(bins), bins]

    def host(self, conf: np.ndarray) -> np.ndarray:
        """`__call__` on a host array ``[B, k]`` (what the per-request policy reads every step)."""
        if not self.rates:
            return conf
        bins = np.minimum(np.searchsorted(self.edges, np.clip(conf, 0.0, 1.0), side="left"), len(self.edges) - 1)
        positions = np.minimum(np.arange(conf.shape[1]), len(self.rates) - 1)
        return np.asarray(self.rates)[positions[None], bins]

    @classmethod
    def fit(cls, pairs: list[tuple[int, float, bool]], num_bins: int = 10) -> Calibration:
        """Isotonic (pool-adjacent-violators) fit per position of ``(position, confidence, accepted)`` pairs, on
        ``num_bins`` equal-width confidence bins."""
        edges = [(b + 1) / num_bins for b in range(num_bins)]
        num_positions = 1 + max((p for p, _, _ in pairs), default=-1)
        rates, base_rates = [], []
        for position in range(num_positions):
            sums, counts = [0.0] * num_bins, [0] * num_bins
            for p, conf, accepted in pairs:
                if p == position:
                    b = min(int(conf * num_bins), num_bins - 1)
                    sums[b] += float(accepted)
                    counts[b] += 1
            rates.append(isotonic(sums, counts))
            base_rates.append(sum(sums) / sum(counts) if sum(counts) else (base_rates[-1] if base_rates else 0.5))
        return cls(edges, rates, base_rates)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (stored in the draft's config, ``dmtp_config["acceptance_calibration"]``)."""
        return {"edges": self.edges, "rates": self.rates, "base_rates": self.base_rates}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Calibration:
        """The inverse of `to_dict` (``None``: uncalibrated; fits stored before base rates existed have none)."""
        if not data:
            return cls()
        return cls(list(data["edges"]), [list(r) for r in data["rates"]], list(data.get("base_rates") or []))


def isotonic(sums: list[float], counts: list[int]) -> list[float]:
    """Non-decreasing rates per bin (pool adjacent violators, count-weighted); empty bins take their neighbours'."""
    blocks = [[s, c, 1] for s, c in zip(sums, counts, strict=True) if c]  # [sum, count, bins merged]
    merged: list[list[float]] = []
    for block in blocks:
        merged.append(block)
        while len(merged) > 1 and merged[-2][0] / merged[-2][1] > merged[-1][0] / merged[-1][1]:
            s, c, n = merged.pop()
            merged[-1] = [merged[-1][0] + s, merged[-1][1] + c, merged[-1][2] + n]
    values = [b[0] / b[1] for b in merged for _ in range(int(b[2]))]
    out = []
    filled = iter(values)
    last = values[0] if values else 0.5
    for count in counts:
        last = next(filled) if count else last
        out.append(last)
    return out


def _host(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values)


class AcceptanceEstimate:
    """What one proposer's rounds accepted, per position: ``prior[j]`` = P(proposal j accepted | earlier accepted),
    and the mean confidence of the tested proposals (an uncalibrated proposer's confidence is rescaled by their
    ratio, `rates`). Starts at ``start`` (a calibration's held-out rates, or optimistic)."""

    def __init__(self, num_positions: int, start: list[float] | None = None, rate: float = PRIOR_RATE) -> None:
        start = start or [PRIOR_ACCEPTANCE]
        self.rate = rate  # the least weight of new evidence (after the running mean)
        self.prior = [start[min(j, len(start) - 1)] for j in range(num_positions)]
        self.seen = [0.0] * num_positions  # tests each prior has absorbed
        self.mean_confidence = [PRIOR_ACCEPTANCE] * num_positions
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # (prior, prior / mean confidence)

    def update(self, j: int, tested: float, accepted: float, confidence: float | None = None) -> None:
        """``tested`` proposals at position j, ``accepted`` of them (``confidence``: the sum of their confidences).
        A running mean at first (after PRIOR_WEIGHT pseudo-tests), then a moving average."""
        self._arrays = None
        self.seen[j] += tested
        weight = max(tested / (self.seen[j] + PRIOR_WEIGHT), self.rate)
        self.prior[j] += weight * (accepted / tested - self.prior[j])
        if confidence is not None:
            self.mean_confidence[j] += weight * (confidence / tested - self.mean_confidence[j])

    def observe(self, widths: Any, accepted: Any, conf: Any = None, first: int = 0) -> None:
        """Rows whose proposals ``first .. first + widths - 1`` were tested in order (``widths`` ``[B]``; ``first``
        > 0: the ones before were accepted already) and ``accepted`` ``[B]`` of them accepted (``conf``
        ``[B, >= first + max width]``: every proposal's confidence). Tensors or arrays."""
        widths, accepted = _host(widths).astype(np.int64), _host(accepted).astype(np.int64)
        k = min(len(self.prior) - first, int(widths.max())) if widths.size else 0
        if k <= 0:
            return
        steps = np.arange(k)
        verified = steps[None] < widths[:, None]
        reached = verified & (steps[None] <= accepted[:, None])  # proposal j was tested (the ones before accepted)
        passed = verified & (steps[None] < accepted[:, None])
        tested, taken = reached.sum(0), passed.sum(0)
        confidence = None if conf is None else (_host(conf)[:, first : first + k] * reached).sum(0)
        for j in np.flatnonzero(tested):
            self.update(first + int(j), float(tested[j]), float(taken[j]), None if conf is None else confidence[j])

    def rates(self, conf: Any, num_rows: int, calibration: Calibration | None = None) -> np.ndarray:
        """``[B, K]`` conditional acceptance (host array): for the first ``conf.shape[1]`` positions from the
        confidences (calibrated, or rescaled to what the rounds accepted), the learned priors beyond."""
        if self._arrays is None or len(self._arrays[0]) != len(self.prior):  # lists may be replaced wholesale
            ratios = [p / max(c, 1e-3) for p, c in zip(self.prior, self.mean_confidence, strict=True)]
            self._arrays = (np.array(self.prior), np.array(ratios))
        prior, ratios = self._arrays
        rates = np.tile(prior, (num_rows, 1))
        if conf is None or conf.shape[1] == 0:
            return rates
        known = conf.shape[1]
        if calibration is not None and calibration.rates:
            rates[:, :known] = calibration.host(np.asarray(conf, dtype=np.float64))
        else:
            rates[:, :known] = np.clip(np.asarray(conf, dtype=np.float64) * ratios[:known], 0.0, 1.0)
        return rates
