"""The drafts retrained on the distilled head against the bundled drafts, per prompt set (distill_eval.sh report).

Reads the bundled comparison (reports/smollm2/eval.json: MTP-1, DFlash, DMTP, DFlash2, DMTP(D2) on the bundled
head) and the new columns (OUT/parts/*/eval.json: `dmtp-dh`, `dmtp-d2-dh`, same prompts and settings), checks that
every new column's output equals the bundled columns' (greedy decoding is lossless: each equals plain `generate`),
and writes OUT/comparison.md and OUT/comparison.json: tau (tokens per verify, bonus included), first-candidate
acceptance and the issue's goals per set.

    python scripts/reproduce/smollm2/distill_compare.py reports/smollm2/eval.json reports/smollm2/distilled-drafts
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BUNDLED = ["mtp1", "dflash", "dmtp", "dflash2", "dmtp-d2"]
NEW = ["dmtp-dh", "dmtp-d2-dh"]
SETS = ["gsm8k", "humaneval", "mt_bench", "alpaca", "held-out-code", "held-out-chat"]


def cells(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """(set, strategy) -> result, over several eval.json files."""
    out = {}
    for path in paths:
        for name, per in json.loads(path.read_text())["results"].items():
            for label, result in per.items():
                out[name, label] = result
    return out


def main() -> None:
    """Print and write the comparison table."""
    bundled_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    table = cells([bundled_path]) | cells(sorted(out.glob("parts/*/eval.json")))
    rows, data = [], {}
    header = (
        "| set | τ DFlash | τ DMTP | τ DMTP-dh | τ DFlash2 | τ D2 | τ D2-dh "
        "| 1st DFlash | 1st DMTP | 1st DMTP-dh | lossless |"
    )
    rows += [header, "|" + "---|" * (header.count("|") - 1)]
    for name in SETS:
        got = {label: table.get((name, label)) for label in BUNDLED + NEW}
        if not all(got[label] for label in ["dflash", "dmtp", "dmtp-dh"]):
            continue
        tau = {k: v["acceptance_length_per_verify"] if v else None for k, v in got.items()}
        first = {k: v["first_candidate_acceptance"] if v else None for k, v in got.items()}
        digests = {v["output_digest"] for v in got.values() if v}
        data[name] = {"tau": tau, "first_candidate": first, "lossless": len(digests) == 1}

        def f(x, pct=False):
            return "–" if x is None else (f"{100 * x:.1f} %" if pct else f"{x:.2f}")

        rows.append(
            f"| {name} | {f(tau['dflash'])} | {f(tau['dmtp'])} | **{f(tau['dmtp-dh'])}** | {f(tau['dflash2'])} | "
            f"{f(tau['dmtp-d2'])} | **{f(tau['dmtp-d2-dh'])}** | {f(first['dflash'], True)} | "
            f"{f(first['dmtp'], True)} | **{f(first['dmtp-dh'], True)}** | {'yes' if len(digests) == 1 else '**no**'} |"
        )
    goals = ["", "| set | τ DMTP-dh / τ DFlash (≥ 1.10) | τ D2-dh / τ DFlash2 (≥ 1.05) | 1st DMTP-dh − DFlash (≥ +5) |"]
    goals.append("|---|---|---|---|")
    for name, d in data.items():
        tau, first = d["tau"], d["first_candidate"]
        d2 = f"{tau['dmtp-d2-dh'] / tau['dflash2']:.3f}" if tau.get("dmtp-d2-dh") and tau.get("dflash2") else "–"
        goals.append(
            f"| {name} | {tau['dmtp-dh'] / tau['dflash']:.3f} | {d2} | "
            f"{100 * (first['dmtp-dh'] - first['dflash']):+.1f} |"
        )
    text = "\n".join(rows + goals) + "\n"
    print(text)
    (out / "comparison.md").write_text(text)
    (out / "comparison.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
