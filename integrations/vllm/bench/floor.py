"""What a speculative engine pays in vLLM before it drafts anything: the same prompts on vLLM plain, on an n-gram
engine whose n-gram never matches (vLLM's own speculative machinery, no proposal ever verified), on a DMTP engine
that verifies nothing (``DMTP_VLLM_VERIFY=none``: lean plain steps, the draft's state caught up in one pass per step
budget of rows, what a plain step of a DMTP engine costs while the race backs off) and on DMTP under its default
policy; every engine alive, jobs interleaved (the order rotating), at one request and at ``--batch`` requests per
job. Prints each engine's tokens per second and its time ratio to plain per job (median, min-max), writes
``reports/vllm/floor.json``.

    .venv/bin/python integrations/vllm/bench/floor.py          # after `make test-vllm`; eager engines
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plugin_overhead import chat_prompts  # noqa: E402
from workers import REPO, Worker, interleaved, parse_cores, spread, vllm_env, vllm_worker  # noqa: E402

NEVER_MATCHES = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 12, "prompt_lookup_max": 12}


def engines(target: str, draft: str, dtype: str, max_num_seqs: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Worker commands and their extra environment, by label."""
    base = vllm_worker(target, dtype, max_num_seqs=max_num_seqs)
    dmtp = vllm_worker(
        target,
        dtype,
        max_num_seqs=max_num_seqs,
        speculative={"method": "dflash", "model": draft, "num_speculative_tokens": 7},
    )
    return {
        "plain": (base, {}),
        "n-gram that never matches": (
            vllm_worker(target, dtype, max_num_seqs=max_num_seqs, speculative=NEVER_MATCHES),
            {},
        ),
        "DMTP verifying nothing": (dmtp, {"DMTP_VLLM_VERIFY": "none"}),
        "DMTP adaptive + lookup": (dmtp, {"DMTP_VLLM_VERIFY": "adaptive", "DMTP_VLLM_PROMPT_LOOKUP": "1"}),
    }


def summarize(answers: dict[str, list[dict]]) -> dict[str, dict]:
    """Tokens per second and the per-job time ratio to plain, per engine; whether its tokens are plain's."""
    plain = answers["plain"]
    out = {}
    for label, got in answers.items():
        tokens = sum(len(t) for a in got for t in a["tokens"])
        out[label] = {
            "tokens_per_second": tokens / sum(a["seconds"] for a in got),
            "ratio_to_plain": spread([p["seconds"] / a["seconds"] for a, p in zip(got, plain, strict=True)]),
            "identical_to_plain": all(a["tokens"] == p["tokens"] for a, p in zip(got, plain, strict=True)),
        }
    return out


def main() -> None:
    """Measure, print, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(Path.home() / ".cache" / "dmtp_hf" / "smollm2"))
    parser.add_argument("--draft", default=str(REPO / "outputs" / "vllm" / "drafts" / "dmtp"), help="exported DMTP")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4, help="requests per job in the batched pass")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", default=f"0-{os.cpu_count() - 1}")
    parser.add_argument("--output", type=Path, default=REPO / "reports" / "vllm" / "floor.json")
    args = parser.parse_args()
    cores = parse_cores(args.cores)
    started = time.time()
    prompts = chat_prompts(args.target, args.prompts, args.max_tokens)
    workers = {
        label: Worker(label, command, vllm_env(cores) | extra, cores)
        for label, (command, extra) in engines(args.target, args.draft, args.dtype, max(args.batch, 1)).items()
    }
    try:
        single = interleaved(workers, [[p] for p in prompts], args.rounds)
        jobs = [prompts[i : i + args.batch] for i in range(0, len(prompts) - args.batch + 1, args.batch)]
        batched = interleaved(workers, jobs, args.rounds)
    finally:
        for worker in workers.values():
            worker.close()
    result = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "one_request": summarize(single),
        f"{args.batch}_requests": summarize(batched),
        "wall_seconds": time.time() - started,
    }
    for part in ("one_request", f"{args.batch}_requests"):
        print(part)
        for label, row in result[part].items():
            ratio = row["ratio_to_plain"]
            print(
                f"  {label:28s} {row['tokens_per_second']:6.1f} tok/s  x{ratio['median']:.2f} "
                f"({ratio['min']:.2f}-{ratio['max']:.2f})  identical {row['identical_to_plain']}"
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
