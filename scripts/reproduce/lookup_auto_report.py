"""The tables of ``reports/performance/lookup/`` from the bench folders ``lookup_auto.sh`` wrote: per set, load and
batch size, ``dmtp:auto`` (prompt lookup competing) against plain ``generate``, prompt lookup alone (Transformers'
prompt lookup, batch size 1 only), the best fixed width (``dmtp``, ``dmtp:1``, ``dmtp:2``) and the draft alone
under auto (``dmtp:auto-draft``); medians of interleaved repeats. Goals: auto >= 0.97x the better of plain and
prompt lookup, >= 0.95x the best fixed width; a ratio whose repeats overlap the goal is marked ``~``.

    .venv/bin/python scripts/reproduce/lookup_auto_report.py [reports/performance/lookup]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIXED = ("dmtp", "dmtp:1", "dmtp:2")


def rates(bench: dict, batch: str) -> dict[str, tuple[float, float, float]]:
    """Method -> (median, min, max) tokens per second at one batch size (methods that ran and matched generate)."""
    out = {}
    for baseline in bench["baselines"]:
        entry = baseline["results"].get(batch) if baseline["skipped"] is None else None
        if not entry or entry.get("matches_generate") is False:
            continue
        runs = entry.get("tokens_per_second_runs") or [entry["tokens_per_second"]]
        out[baseline["name"]] = (
            entry.get("median_tokens_per_second", entry["tokens_per_second"]),
            min(runs),
            max(runs),
        )
    return out


def cell(ours: tuple[float, float, float], other: tuple[float, float, float], goal: float) -> str:
    """``ratio`` of medians, with ``✓``/``✗`` against the goal (``~``: the repeats overlap it)."""
    ratio = ours[0] / other[0]
    best, worst = ours[2] / other[1], ours[1] / other[2]
    mark = "✓" if ratio >= goal else ("~" if best >= goal >= worst else "✗")
    return f"{ratio:.2f} {mark}"


def main() -> None:
    """Print the markdown table."""
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "reports/performance/lookup")
    print(
        "| run | B | auto × plain | auto × lookup alone | auto × max(plain, lookup) | auto × best fixed | "
        "auto-draft × plain |"
    )
    print("|---|---|---|---|---|---|---|")
    for folder in sorted(p.parent for p in root.glob("*/bench.json")):
        bench = json.loads((folder / "bench.json").read_text())
        for batch in map(str, bench["settings"]["batch_sizes"]):
            r = rates(bench, batch)
            if "dmtp:auto" not in r or "generate" not in r:
                continue
            auto, plain = r["dmtp:auto"], r["generate"]
            lookup = r.get("prompt_lookup")
            floor = max((plain, lookup) if lookup else (plain,), key=lambda x: x[0])
            fixed = max((r[m] for m in FIXED if m in r), key=lambda x: x[0])
            row = [
                folder.name,
                batch,
                cell(auto, plain, 0.97),
                cell(auto, lookup, 0.97) if lookup else "—",
                cell(auto, floor, 0.97),
                cell(auto, fixed, 0.95),
                cell(r["dmtp:auto-draft"], plain, 0.97) if "dmtp:auto-draft" in r else "—",
            ]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
