"""Markdown tables of fixed K against ``verify_length=auto`` from `dmtp eval` / `dmtp bench` JSON (one run each).

    python scripts/reproduce/widths_report.py --eval outputs/performance/bundled/eval/eval.json \
        --bench outputs/performance/bundled/bench/bench.json \
        --t1 outputs/performance/bundled/t1_{rejection,block}/eval.json

Per workload and drafter: acceptance length per request, speedup over plain ``generate`` (same run) for fixed K
and auto, auto / fixed, the mean verified width and the share of rounds that ran no drafter stage; per batch size
from the bench; τ at temperature 1 for rejection against block verification.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _mean_width(row: dict) -> str:
    widths = {int(k): v for k, v in (row.get("verify_widths") or {}).items()}
    total = sum(widths.values())
    return f"{sum(k * v for k, v in widths.items()) / total:.2f}" if total else f"{row['num_candidates']} (fixed)"


def eval_table(path: Path) -> str:
    """Fixed vs auto per workload (the ``overall`` row last)."""
    data = json.loads(path.read_text())
    labels = [s["label"] for s in data["strategies"]]
    bases = [label for label in labels if ":" not in label and f"{label}:auto" in labels]
    lines = [
        "| workload | drafter | τ fixed | τ auto | speedup fixed | speedup auto | auto / fixed | mean width (auto) "
        "| plain rounds (auto) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sets = [*data["results"], "overall"]
    for name in sets:
        rows = data["overall"] if name == "overall" else data["results"][name]
        for base in bases:
            fixed, auto = rows[base], rows[f"{base}:auto"]
            plain = auto.get("plain_rounds", 0) / max(auto["num_rounds"], 1)
            lines.append(
                f"| {name} | {base} | {fixed['acceptance_length_per_request']:.2f} | "
                f"{auto['acceptance_length_per_request']:.2f} | {fixed['speedup']:.2f}× | {auto['speedup']:.2f}× | "
                f"{auto['speedup'] / fixed['speedup']:.2f} | {_mean_width(auto)} | {100 * plain:.0f} % |"
            )
    return "\n".join(lines)


def bench_table(path: Path) -> str:
    """Speedup over plain ``generate`` (same run) per method and batch size; plain ``generate`` in tokens/s."""
    baselines = json.loads(path.read_text())["baselines"]
    sizes = sorted({int(b) for row in baselines for b in row["results"]})
    lines = ["| method | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for row in baselines:
        if row.get("skipped"):
            continue
        cells = []
        for b in sizes:
            result = row["results"].get(str(b))
            if not result:
                cells.append("–")
            elif row["name"] == "generate":
                cells.append(f"{result['tokens_per_second']:.0f} tok/s")
            else:
                cells.append(f"{result['speedup']:.2f}×")
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def t1_table(rejection: Path, block: Path) -> str:
    """τ per request at temperature 1, token-wise rejection against block verification."""
    one, two = json.loads(rejection.read_text()), json.loads(block.read_text())
    labels = [s["label"] for s in one["strategies"]]
    lines = ["| workload | drafter | τ rejection | τ block | block − rejection |", "|---|---|---|---|---|"]
    for name in [*one["results"], "overall"]:
        rows_one = one["overall"] if name == "overall" else one["results"][name]
        rows_two = two["overall"] if name == "overall" else two["results"][name]
        for label in labels:
            a = rows_one[label]["acceptance_length_per_request"]
            b = rows_two[label]["acceptance_length_per_request"]
            lines.append(f"| {name} | {label} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Print the tables for the files given."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval", type=Path)
    parser.add_argument("--bench", type=Path)
    parser.add_argument("--t1", type=Path, nargs=2, metavar=("REJECTION", "BLOCK"))
    args = parser.parse_args()
    if args.eval:
        print(eval_table(args.eval), end="\n\n")
    if args.bench:
        print(bench_table(args.bench), end="\n\n")
    if args.t1:
        print(t1_table(*args.t1))


if __name__ == "__main__":
    main()
