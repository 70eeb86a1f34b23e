"""A serving engine over time: successive batches of requests on engines that stay alive, as a server's would.

`compare.py` runs one or two batches per batch size, so what it measures at 16 requests is mostly the DMTP
policy learning that batch size (its first plain window, its first free window, the race's first judgement).
A server runs for hours. Here every engine serves ``--jobs`` successive batches of ``--batch`` different prompts
(the bundled GSM8K, HumanEval and MT-Bench first turns, in turn), the jobs interleaved across engines (the order
rotating), and the time ratio to vLLM plain is reported per job in the order they ran, so the cold start and the
steady state read apart: ``steady`` is the median over the second half of the jobs. The DMTP engine's policy
report (`dmtp_vllm.report`: plain steps, the race's back-offs and ratios) is read at the end.

    .venv-vllm/bin/python integrations/vllm/bench/serving.py --batch 16 --jobs 6   # after `make test-vllm`

Standard library only; writes ``reports/vllm/serving-<batch>.json`` (``serving-<batch>-<sets>.json`` with
``--sets``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plugin_overhead import chat_prompts  # noqa: E402
from workers import NGRAM, REPO, Worker, interleaved, parse_cores, spread, vllm_env, vllm_worker  # noqa: E402

DMTP_LABEL = "DMTP adaptive + lookup"


def engines(
    target: str, draft: str, dtype: str, batch: int, profile: bool = False
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Worker commands and their extra environment, by label (``profile``: the DMTP engine times each part of its
    round, ``DMTP_VLLM_PROFILE=1``, reported in its policy report)."""
    dmtp = {"method": "dflash", "model": draft, "num_speculative_tokens": 7}
    dmtp_env = {"DMTP_VLLM_VERIFY": "adaptive", "DMTP_VLLM_PROMPT_LOOKUP": "1"}
    return {
        "plain": (vllm_worker(target, dtype, max_num_seqs=batch), {}),
        "n-gram": (vllm_worker(target, dtype, max_num_seqs=batch, speculative=NGRAM), {}),
        DMTP_LABEL: (
            vllm_worker(target, dtype, max_num_seqs=batch, speculative=dmtp, policy_report=True),
            dmtp_env | ({"DMTP_VLLM_PROFILE": "1"} if profile else {}),
        ),
    }


def policy_report(worker: Worker) -> dict:
    """The DMTP policy's report from a worker (its counters, estimates and the race's state)."""
    return worker.run([], report=True)["report"]


def main() -> None:
    """Serve, print per-job ratios and the steady state, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(Path.home() / ".cache" / "dmtp_hf" / "smollm2"))
    parser.add_argument("--draft", default=str(REPO / "outputs" / "vllm" / "drafts" / "dmtp"), help="exported DMTP")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16, help="requests submitted together per job")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--sets", default="gsm8k,humaneval,mt_bench", help="bundled sets the prompts come from")
    parser.add_argument("--profile", action="store_true", help="seconds per part of the DMTP round, summed")
    parser.add_argument("--cores", default=f"0-{os.cpu_count() - 1}")
    parser.add_argument("--output", type=Path, default=None, help="default: reports/vllm/serving-<batch>.json")
    args = parser.parse_args()
    sets = tuple(args.sets.split(","))
    name = f"serving-{args.batch}" + ("" if args.sets == parser.get_default("sets") else "-" + "-".join(sets))
    output = args.output or REPO / "reports" / "vllm" / f"{name}.json"
    cores = parse_cores(args.cores)
    started = time.time()
    prompts = chat_prompts(args.target, args.batch * args.jobs, args.max_tokens, sets)
    jobs = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    workers = {
        label: Worker(label, command, vllm_env(cores) | extra, cores)
        for label, (command, extra) in engines(args.target, args.draft, args.dtype, args.batch, args.profile).items()
    }
    try:
        answers = interleaved(workers, jobs)
        report = policy_report(workers[DMTP_LABEL])
    finally:
        for worker in workers.values():
            worker.close()
    plain = answers["plain"]
    half = len(jobs) // 2
    result: dict = {"settings": {k: str(v) for k, v in vars(args).items()}, "engines": {}}
    for label, got in answers.items():
        ratios = [p["seconds"] / a["seconds"] for a, p in zip(got, plain, strict=True)]
        tokens = sum(len(t) for a in got for t in a["tokens"])
        result["engines"][label] = {
            "identical_to_plain": all(a["tokens"] == p["tokens"] for a, p in zip(got, plain, strict=True)),
            "tokens_per_second": tokens / sum(a["seconds"] for a in got),
            "ratio_per_job": ratios,
            "ratio": spread(ratios),
            "steady": statistics.median(ratios[half:]),
            "tau_per_verify": 1 + sum(a["accepted"] for a in got) / max(1, sum(a["drafts"] for a in got)),
            "policy_per_job": [a.get("policy") for a in got] if label == DMTP_LABEL else None,
        }
    result["dmtp_policy_report"] = report
    # seconds of the whole run per engine, for reading the profile against (the DMTP engine's parts sum into it)
    result["seconds"] = {label: sum(a["seconds"] for a in got) for label, got in answers.items()}
    result["wall_seconds"] = time.time() - started
    print(f"{args.batch} requests per job, {len(jobs)} jobs of {args.max_tokens} new tokens, {args.dtype}, eager")
    for label, row in result["engines"].items():
        per_job = " ".join(f"{r:.2f}" for r in row["ratio_per_job"])
        print(
            f"  {label:24s} {row['tokens_per_second']:6.1f} tok/s  x plain per job: {per_job}  "
            f"steady x{row['steady']:.2f}  identical {row['identical_to_plain']}"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
