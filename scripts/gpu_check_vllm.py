"""vLLM on a GPU, one shot: DMTP with a family's own MTP head, on vLLM's V1 and V2 model runners; fails loudly.

The sibling of ``scripts/gpu_check.py`` for the engine. It runs the native-MTP family checks of
``integrations/vllm/bench/families.py`` (tiny checkpoints in each family's real layout; a DMTP draft continued from
a z-lab-layout DFlash checkpoint; every engine in its own process) for Qwen3-Next and Qwen3.5, with prefix caching
on, once per model runner, and prints one line per check:

* V1 and V2: plain decoding and vLLM's ``mtp`` method start and decode;
* V1: DMTP starts, its greedy tokens equal ``mtp``'s (the first prompt alone and four together), and its T1 is
  ``mtp``'s first proposal at every position both drafted at;
* V2: a DMTP draft is refused by name (the plugin runs on V1, where it replaces the drafter);
* and, for information (not a check), whether vLLM's n-gram method, which proposes nothing at most steps on these
  prompts, decodes as plain decoding does: on the CPU build it does not on hybrid targets (a request verifying no
  proposal decodes wrong tokens), which is why the plugin verifies every proposal there; on a GPU, this line says
  whether that rule is needed.

vLLM's environment is ``$DMTP_VLLM_PYTHON`` (a CUDA build's; default the repository's ``.venv-vllm``), the
checkpoints are made in this one. An engine that cannot start is a failed check, never a skip. Writes
``reports/gpu/vllm.json``; exit code 1 if any check failed.

    DMTP_VLLM_PYTHON=/opt/vllm/bin/python python -u scripts/gpu_check_vllm.py
    python -u scripts/gpu_check_vllm.py --runners V1 --cpu     # this CPU: bf16, no prefix caching, V1 only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "integrations" / "vllm" / "bench"))
import families  # noqa: E402

RUNNERS = {"V1": "0", "V2": "1"}  # VLLM_USE_V2_MODEL_RUNNER


def checks(runner: str, rows: dict[str, dict]) -> list[dict]:
    """The checks of one runner's survey rows (module docstring): ``{"check", "ok", "detail"}`` each."""
    out = []

    def check(name: str, ok: bool, detail: object = "") -> None:
        out.append({"check": f"{runner} {name}", "ok": bool(ok), "detail": str(detail)[:300]})

    for family, row in rows.items():
        for method in ("plain", "mtp"):
            check(f"{family} {method} decodes", row[method]["ok"], row[method].get("error", ""))
        dmtp = row["dmtp"]
        if runner == "V1":
            check(f"{family} DMTP decodes", dmtp["ok"], dmtp.get("error", ""))
            check(f"{family} DMTP greedy = mtp", row["dmtp_identical"] and row["dmtp_compared_with"] == "mtp", "")
            first = row["t1_identical_to_mtp"] or {"identical": False, "positions": 0}
            check(f"{family} T1 = mtp's first token", first["identical"] and first["positions"] > 0, first)
        else:
            refused = not dmtp["ok"] and "V1 model runner" in dmtp.get("error", "")
            check(f"{family} DMTP refused by name", refused, dmtp.get("error", "it ran"))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the survey per runner, print each check, write the report; 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", default="V1,V2", help="model runners to check (V1, V2)")
    parser.add_argument("--families", default="qwen3_next,qwen3_5")
    parser.add_argument("--cpu", action="store_true", help="the CPU build's engine settings (no prefix caching)")
    parser.add_argument("--output", type=Path, default=REPO / "reports" / "gpu" / "vllm.json")
    args = parser.parse_args(argv)
    engine = None if args.cpu else {"prefix_caching": True}
    report: dict[str, object] = {"vllm_python": str(families.VLLM_PYTHON), "runners": {}}
    failed = 0
    for runner in args.runners.split(","):
        with tempfile.TemporaryDirectory() as directory:
            environ = {"VLLM_USE_V2_MODEL_RUNNER": RUNNERS[runner]}
            rows = families.survey(args.families.split(","), Path(directory), engine=engine, environ=environ)
            for family, row in rows.items():  # (the checkpoints are still in `directory`)
                ngram = families.probe(row["path"], family, "ngram", engine=engine, environ=environ)
                row["ngram"], row["ngram_identical_to_plain"] = ngram, families.same_tokens(row["plain"], ngram)
                print(f"INFO  {runner} {family} n-gram greedy = plain: {row['ngram_identical_to_plain']}", flush=True)
        results = checks(runner, rows)
        for result in results:
            print(f"{'PASS' if result['ok'] else 'FAIL'}  {result['check']}  {result['detail']}", flush=True)
        failed += sum(not result["ok"] for result in results)
        report["runners"][runner] = {"checks": results, "rows": rows}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")  # rewritten per runner: a timeout keeps V1
    print(f"{failed} check(s) failed" if failed else "all checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
