"""``dmtp calibrate``: how often a draft's candidates are accepted at each confidence, for ``verify_length="auto"``.

Every strategy with a draft checkpoint decodes the prompts verifying all K candidates, while a `CalibrationRecorder`
notes, per tested candidate, ``(position, confidence, accepted)``; `widths.Calibration.fit` turns them into one
monotone map per position, stored in the draft's ``config.json`` (``dmtp_config["acceptance_calibration"]``) where
``verify_length="auto"`` reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..assistant.widths import AutoWidth, Calibration, CostModel
from ..modeling.io import atomic_write_json

__all__ = ["CalibrationRecorder", "plot_reliability", "reliability", "split_pairs", "store_calibration"]


class CalibrationRecorder(AutoWidth):
    """A width policy that always verifies every candidate and records, for each candidate the target tested (the
    ones before it accepted), its position, the draft's confidence in it and whether it was accepted."""

    def __init__(self, max_candidates: int) -> None:
        super().__init__(CostModel({1: 1.0}), Calibration(), max_candidates)
        self.pairs: list[tuple[int, float, bool]] = []

    def best(self, known: torch.Tensor, draft_stages: list[list[str]], drafted: int = 0) -> int:
        """Every candidate, always (the recording needs the whole block)."""
        return self.max_candidates

    def observe(self, conf: torch.Tensor, accepted: torch.Tensor, predicted: torch.Tensor | None = None) -> None:
        """Record the round: ``conf`` ``[B, k]``, ``accepted`` ``[B]`` accepted counts."""
        steps = torch.arange(conf.shape[1], device=conf.device).expand_as(conf)
        tested = steps <= accepted[:, None]
        positions, confidence = steps[tested].tolist(), conf[tested].tolist()
        passed = (steps < accepted[:, None])[tested].tolist()
        self.pairs += list(zip(positions, confidence, passed, strict=True))


def store_calibration(checkpoint: str | os.PathLike, calibration: Calibration) -> Path:
    """Write ``calibration`` into the checkpoint's ``config.json`` (``dmtp_config["acceptance_calibration"]``),
    atomically (a temporary file renamed over the old one). Returns the file written."""
    path = Path(checkpoint) / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("dmtp_config", {})["acceptance_calibration"] = calibration.to_dict()
    return atomic_write_json(path, config, indent=2, sort_keys=True)


def split_pairs(pairs: list[tuple[int, float, bool]], held_out: float, seed: int = 0):
    """``(fit, held)``: a seeded random split of the recorded pairs (``held_out`` the held fraction)."""
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(round(len(pairs) * held_out))
    return [pairs[i] for i in order[cut:]], [pairs[i] for i in order[:cut]]


def reliability(calibration: Calibration, pairs: list[tuple[int, float, bool]], num_bins: int = 10):
    """Per candidate position, on ``pairs`` (held out from the fit): the Brier score of the raw confidence and of the
    calibrated prediction, and the reliability curve (mean prediction vs observed acceptance per prediction bin)."""
    rows = []
    for position in range(1 + max((p for p, _, _ in pairs), default=-1)):
        own = [(conf, accepted) for p, conf, accepted in pairs if p == position]
        if not own:
            continue
        conf = torch.tensor([[c] for c, _ in own])
        observed = torch.tensor([float(a) for _, a in own])
        # the map of this position: the confidence in column `position` of a [N, position + 1] block
        predicted = calibration(torch.cat([torch.zeros(len(own), position), conf], dim=1))[:, position]
        bins = (predicted * num_bins).long().clamp(max=num_bins - 1)
        curve = [
            {
                "predicted": float(predicted[bins == b].mean()),
                "observed": float(observed[bins == b].mean()),
                "count": int((bins == b).sum()),
            }
            for b in range(num_bins)
            if bool((bins == b).any())
        ]
        rows.append(
            {
                "position": position + 1,
                "tested": len(own),
                "acceptance": float(observed.mean()),
                "brier_confidence": float(((conf[:, 0] - observed) ** 2).mean()),
                "brier_calibrated": float(((predicted - observed) ** 2).mean()),
                "curve": curve,
            }
        )
    return rows


def plot_reliability(report: dict[str, list[dict[str, Any]]], path: str | os.PathLike) -> Path:
    """One panel per strategy: observed acceptance against the calibrated prediction, a line per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report), figsize=(4.2 * len(report), 4), squeeze=False)
    for axis, (label, rows) in zip(axes[0], report.items(), strict=True):
        axis.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        for row in rows:
            curve = row["curve"]
            axis.plot(
                [c["predicted"] for c in curve],
                [c["observed"] for c in curve],
                marker="o",
                markersize=3,
                label=f"T{row['position']} (Brier {row['brier_calibrated']:.3f})",
            )
        axis.set(
            title=f"{label}: held-out reliability",
            xlabel="predicted P(accepted)",
            ylabel="observed",
            xlim=(0, 1),
            ylim=(0, 1),
        )
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
