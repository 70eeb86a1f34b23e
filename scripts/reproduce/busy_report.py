"""Tables of the quiet and loaded benches (scripts/reproduce/busy_machine.sh) for reports/performance/README.md.

Reads OUT/{bundled,smollm2,mtp}-burner{0,1}/bench.json and prints markdown: per target, one row per method with its
speedup over plain `generate` (median of the repeats) and the spread of the repeats, quiet and with the burner, per
batch size; then the goals of `verify_length="auto"` per drafter: >= 0.97x plain and >= 0.95x the better of its two
fixed widths in the run (K, and 0 = plain decoding).

    python scripts/reproduce/busy_report.py [OUT]     (default reports/performance/busy)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {
    "bundled": "Bundled target (hybrid Qwen3.5 layout)",
    "smollm2": "SmolLM2-135M-Instruct",
    "mtp": "Tiny DeepSeek-V3",
}


def load(out: Path, target: str) -> dict[int, dict]:
    """The bench of ``target`` per burner cores (0: quiet, 1: a burner on one core), as far as they exist."""
    runs = {}
    for burner in (0, 1):
        path = out / f"{target}-burner{burner}" / "bench.json"
        if path.exists():
            runs[burner] = json.loads(path.read_text())
    return runs


def median_speedup(baseline: dict, plain: dict, bs: str) -> tuple[float, float] | None:
    """(median tokens/s over plain's median, the method's spread) at batch size ``bs``."""
    entry, reference = baseline["results"].get(bs), plain["results"].get(bs)
    if not entry or not reference or not entry.get("median_tokens_per_second"):
        return None
    return entry["median_tokens_per_second"] / reference["median_tokens_per_second"], entry.get("spread") or 0.0


def table(runs: dict[int, dict]) -> list[str]:
    """Markdown lines: each method's median speedup and spread per batch size, quiet and loaded side by side."""
    first = next(iter(runs.values()))
    batch_sizes = [str(b) for b in first["settings"]["batch_sizes"]]
    columns = [(burner, bs) for bs in batch_sizes for burner in sorted(runs)]
    head = ["method"] + [f"B={bs} {'burner' if burner else 'quiet'}" for burner, bs in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for index, baseline in enumerate(first["baselines"]):
        if baseline["skipped"]:
            lines.append(f"| {baseline['name']} | skipped: {baseline['skipped']} |" + " |" * (len(columns) - 1))
            continue
        cells = []
        for burner, bs in columns:
            run = runs[burner]
            value = median_speedup(run["baselines"][index], run["baselines"][0], bs)
            cells.append("" if value is None else f"{value[0]:.2f}× ±{50 * value[1]:.0f}%")
        lines.append(f"| {baseline['name']} | " + " | ".join(cells) + " |")
    settings = [
        f"{burner and 'burner' or 'quiet'}: {r['settings'].get('threads')} thread(s)" for burner, r in runs.items()
    ]
    lines.append("")
    lines.append(
        f"Median of {first['settings']['repeats']} interleaved repeats over plain `generate`'s median, ± half the range"
        f" of the method's repeats; {first['settings']['num_prompts']} prompts, {first['settings']['max_new_tokens']}"
        f" new tokens; {', '.join(settings)}."
    )
    return lines


def goals(runs: dict[int, dict]) -> list[str]:
    """Markdown lines: the goals of ``auto`` per drafter, condition and batch size."""
    rows = [
        "| drafter | condition | B | auto × plain | auto × better fixed width (K or 0) | met |",
        "|---|---|---|---|---|---|",
    ]
    for burner, run in sorted(runs.items()):
        by_name = {b["name"]: b for b in run["baselines"]}
        plain = run["baselines"][0]
        for name, baseline in by_name.items():
            if not name.endswith(":auto") or baseline["skipped"]:
                continue
            fixed = by_name.get(name.removesuffix(":auto"))
            for bs in (str(b) for b in run["settings"]["batch_sizes"]):
                auto = median_speedup(baseline, plain, bs)
                fixed_k = median_speedup(fixed, plain, bs) if fixed else None
                if auto is None:
                    continue
                better = max(1.0, fixed_k[0] if fixed_k else 0.0)
                met = auto[0] >= 0.97 and auto[0] >= 0.95 * better
                rows.append(
                    f"| {name.removesuffix(':auto')} | {'burner' if burner else 'quiet'} | {bs} | {auto[0]:.2f} | "
                    f"{auto[0] / better:.2f} | {'yes' if met else '**no**'} |"
                )
    return rows


def main() -> None:
    """Print every target's tables that the benches exist for."""
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "reports/performance/busy")
    for target, title in TARGETS.items():
        runs = load(out, target)
        if not runs:
            continue
        print(f"#### {title}\n")
        print("\n".join(table(runs)))
        print()
        if any(b["name"].endswith(":auto") for r in runs.values() for b in r["baselines"]):
            print("\n".join(goals(runs)))
            print()


if __name__ == "__main__":
    main()
