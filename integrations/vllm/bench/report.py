"""``reports/vllm/README.md`` tables from ``results.json`` (written by ``compare.py``); numbers are never typed.

.venv/bin/python integrations/vllm/bench/report.py reports/vllm/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SET_NAMES = {
    "gsm8k": "GSM8K",
    "humaneval": "HumanEval",
    "mt_bench": "MT-Bench",
    "alpaca": "Alpaca",
    "heldout_code": "held-out code",
    "heldout_chat": "held-out chat",
}


def number(value: float | None, digits: int = 2, suffix: str = "") -> str:
    """A table cell (an em dash where the method has no value, e.g. tau of plain decoding)."""
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def concurrency_1_table(per_set: dict) -> list[str]:
    """Rows: methods; per set: tau per verify / first-candidate acceptance / speedup (median) / lossless."""
    sets = list(per_set)
    methods = list(per_set[sets[0]])
    lines = [
        "| method | " + " | ".join(SET_NAMES.get(s, s) for s in sets) + " |",
        "|---|" + "---|" * len(sets),
    ]
    for method in methods:
        cells = []
        for s in sets:
            r = per_set[s][method]
            first = None if r["first_candidate_acceptance"] is None else 100 * r["first_candidate_acceptance"]
            cells.append(
                f"{number(r['tau_per_verify'])} / {number(first, 0, '%')} / "
                f"{number(r['speedup_vs_plain'].get('median'), 2, 'x')}{'' if r['lossless'] else ' **not lossless**'}"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def batch_table(batches: dict) -> list[str]:
    """Rows: methods; per batch size: tokens/s (median) and the ratio to plain (median, min-max)."""
    sizes = list(batches)
    methods = list(batches[sizes[0]])
    lines = [
        "| method | " + " | ".join(f"{size} requests: tokens/s, × plain (min-max)" for size in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for method in methods:
        cells = []
        for size in sizes:
            r = batches[size][method]
            ratio, rate = r["speedup_vs_plain"], r["tokens_per_second"]
            if not ratio:  # fewer prompts than one batch of this size
                cells.append("—")
                continue
            cell = f"{rate['median']:.1f}, {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
            cells.append(cell + ("" if r["lossless"] else " **not lossless**"))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def policy_table(per_set: dict, batches: dict) -> list[str]:
    """Rows: the adaptive DMTP columns; per set (concurrency 1) and batch size: the mean verified width per request
    and step / the share of plain steps / the share of request-steps that verified prompt lookup."""
    sets = list(per_set)
    methods = [m for m in per_set[sets[0]] if per_set[sets[0]][m].get("policy")]
    sizes = list(batches)
    header = [SET_NAMES.get(s, s) for s in sets] + [f"{size} requests" for size in sizes]
    lines = ["| method | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for method in methods:
        choices = [per_set[s][method]["policy"] for s in sets]
        choices += [batches[size].get(method, {}).get("policy") for size in sizes]
        cells = [
            "—"
            if c is None
            else f"{c['mean_verified_width']:.2f} / {100 * c['plain_step_share']:.0f}% / {100 * c['lookup_share']:.0f}%"
            for c in choices
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    """Print the tables of a results file (markdown)."""
    results = json.loads(Path(sys.argv[1]).read_text())
    for dtype in results["runs"]:
        settings = results["settings"].get(dtype)
        if settings is None:  # a run whose settings an older compare.py did not keep per dtype
            print(f"Settings ({dtype}): not recorded.\n")
            continue
        minutes = results.get("wall_seconds", {}).get(dtype, 0) / 60
        print(
            f"Settings ({dtype}): {settings['limit']} prompts per set, {settings['max_tokens']} new tokens, greedy; "
            f"{'eager' if settings.get('eager', False) else 'compiled'} vLLM engines; batches of "
            f"{settings.get('batch_sizes', '4,16')} repeated {settings['batch_repeats']} times; "
            f"{settings['cpu_count']} CPU cores; wall time {minutes:.0f} min.\n"
        )
    for dtype, run in results["runs"].items():
        print(f"### {dtype}: one request at a time\n")
        print("τ per verify / first-candidate acceptance / time ratio to the same engine's plain decoding (median)\n")
        print("\n".join(concurrency_1_table(run["concurrency_1"])) + "\n")
        print(f"### {dtype}: requests submitted together (vLLM)\n")
        print("\n".join(batch_table(run["batches"])) + "\n")
        if any(r.get("policy") for r in next(iter(run["concurrency_1"].values())).values()):
            print(f"### {dtype}: what the adaptive policy chose\n")
            print("mean verified width per request and step / share of plain steps / share of request-steps that")
            print("verified prompt lookup\n")
            print("\n".join(policy_table(run["concurrency_1"], run["batches"])) + "\n")


if __name__ == "__main__":
    main()
