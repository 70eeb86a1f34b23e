"""``dmtp calibrate``: how often a draft's candidates are accepted at each confidence, for ``verify_length="auto"``.

Every strategy with a draft checkpoint decodes the prompts verifying all K candidates, while a `CalibrationRecorder`
notes, per tested candidate, ``(position, confidence, accepted)``; `widths.Calibration.fit` turns them into one
monotone map per position, stored in the draft's ``config.json`` (``dmtp_config["acceptance_calibration"]``) where
``verify_length="auto"`` reads it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..assistant.widths import AutoWidth, Calibration, CostModel

__all__ = ["CalibrationRecorder", "store_calibration"]


class CalibrationRecorder(AutoWidth):
    """A width policy that always verifies every candidate and records, for each candidate the target tested (the
    ones before it accepted), its position, the draft's confidence in it and whether it was accepted."""

    def __init__(self, max_candidates: int) -> None:
        super().__init__(CostModel({1: 1.0}), Calibration(), max_candidates)
        self.pairs: list[tuple[int, float, bool]] = []

    def best(self, known: torch.Tensor, draft_stages: list[list[str]]) -> int:
        """Every candidate, always (the recording needs the whole block)."""
        return self.max_candidates

    def observe(self, conf: torch.Tensor, accepted: torch.Tensor) -> None:
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
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".json")
    with os.fdopen(handle, "w") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    os.replace(temporary, path)
    return path


def calibration_table(calibration: Calibration, pairs: list[tuple[int, float, bool]]) -> list[dict[str, Any]]:
    """Per position: the number of tested candidates, their acceptance rate and the fitted rate per confidence bin."""
    rows = []
    for position, rates in enumerate(calibration.rates):
        seen = [accepted for p, _, accepted in pairs if p == position]
        rows.append(
            {
                "position": position + 1,
                "tested": len(seen),
                "acceptance": sum(seen) / len(seen) if seen else None,
                "rates": rates,
            }
        )
    return rows
