"""Side by side in one engine: vLLM plain, n-gram, DFlash and DMTP (dmtp-vllm: every proposal verified, the adaptive
policy, the adaptive policy with prompt lookup) on SmolLM2-135M-Instruct, next to Transformers plain ``generate``
and dmtp-hf's own DMTP engine, on the same prompts (``reports/vllm/``).

Every method runs in its own worker process (``vllm_worker.py`` in vLLM's environment, ``hf_worker.py`` in
dmtp-hf's), started once; the jobs are interleaved (each prompt goes to every method in turn, the order rotating),
so that machine load hits every column alike. Per dtype (vLLM in fp32 and bf16; Transformers in fp32):

1. every prompt alone (concurrency 1): tokens (lossless = identical to the same engine's plain greedy output, same
   dtype), acceptance length per verify (``1 + accepted / verify rounds``) and per request, first-candidate
   acceptance (rounds whose first proposal was accepted), and the time ratio to plain on that prompt;
2. vLLM only: batches of 4 and 16 prompts submitted together, repeated, tokens per second and the ratio to plain on
   the same batch (median, min-max).

For the adaptive DMTP columns, what the policy chose (``dmtp_vllm.report``): the mean verified width per request
and step, the share of steps that verified nothing (plain steps) and the share of request-steps that verified prompt
lookup. vLLM engines run eager (no torch.compile) unless ``--compiled``. A dtype already in ``--output`` is kept
unless it is run again (``--dtypes``), so the two dtypes can run as two jobs.

    .venv/bin/python integrations/vllm/bench/compare.py --limit 10 --max-tokens 128     # after `make test-vllm`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from dmtp_hf.evaluation.prompts import load_bundled_set, load_prompt_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers import HERE, NGRAM, REPO, VLLM_PYTHON, Worker, interleaved, parse_cores, spread, vllm_env, vllm_worker  # noqa: E402

BUNDLE = REPO / "assets" / "dmtp_hf_assets" / "models" / "smollm2"  # the repository-local assets package
SETS = ["gsm8k", "humaneval", "mt_bench", "alpaca", "heldout_code", "heldout_chat"]
HELD_OUT = {
    "heldout_code": "outputs/corpus/bench/code_question.jsonl",
    "heldout_chat": "outputs/corpus/bench/chat_question.jsonl",
}


def build_held_out_sets() -> None:
    """The held-out sets come from the offline corpus (`scripts/reproduce/build_corpus.py`, seconds, deterministic):
    built when missing."""
    if not all((REPO / path).is_file() for path in HELD_OUT.values()):
        script = REPO / "scripts" / "reproduce" / "build_corpus.py"
        subprocess.run([sys.executable, str(script), "--out", str(REPO / "outputs" / "corpus")], check=True, cwd=REPO)


def load_prompts(tokenizer, limit: int, max_tokens: int) -> dict[str, list[dict]]:
    """The first user turn of the first ``limit`` prompts of each set, as chat-template token ids."""
    sets = {}
    for name in SETS:
        prompt_set = (
            load_prompt_file(REPO / HELD_OUT[name], name=name, limit=limit)
            if name in HELD_OUT
            else load_bundled_set(name, limit=limit)
        )
        sets[name] = [
            {"prompt_token_ids": chat_ids(tokenizer, p.turns[0]), "max_tokens": max_tokens} for p in prompt_set.prompts
        ]
    return sets


def chat_ids(tokenizer, request: str) -> list[int]:
    """A one-turn chat's token ids, ready for the assistant's answer."""
    messages = [{"role": "user", "content": request}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def plain_label(label: str, dtype: str) -> str:
    """The plain-decoding column of the engine a column runs in (its lossless and speed reference)."""
    return f"vLLM plain {dtype}" if label.startswith("vLLM") else f"Transformers plain {dtype}"


# The DMTP columns: one draft folder, three policies (the plugin reads them from the environment).
DMTP_POLICIES = {
    "DMTP all K": {"DMTP_VLLM_VERIFY": "all"},
    "DMTP adaptive": {"DMTP_VLLM_VERIFY": "adaptive", "DMTP_VLLM_PROMPT_LOOKUP": "0"},
    "DMTP adaptive + lookup": {"DMTP_VLLM_VERIFY": "adaptive", "DMTP_VLLM_PROMPT_LOOKUP": "1"},
}


def methods(target: str, drafts: Path, dtype: str, threads: int, eager: bool) -> dict[str, tuple[list[str], dict]]:
    """Worker commands and their extra environment, by column label, for one dtype."""
    spec = {
        "n-gram": NGRAM,
        "DFlash": {"method": "dflash", "model": str(drafts / "dflash"), "num_speculative_tokens": 7},
    }
    dmtp = {"method": "dflash", "model": str(drafts / "dmtp"), "num_speculative_tokens": 7}
    out = {f"vLLM plain {dtype}": (vllm_worker(target, dtype, eager), {})}
    out.update(
        {f"vLLM {name} {dtype}": (vllm_worker(target, dtype, eager, speculative=c), {}) for name, c in spec.items()}
    )
    for name, env in DMTP_POLICIES.items():
        command = vllm_worker(target, dtype, eager, speculative=dmtp, policy_report="adaptive" in name)
        out[f"vLLM {name} {dtype}"] = (command, env)
    if dtype == "float32":
        hf = [sys.executable, str(HERE / "hf_worker.py"), "--target", target, "--threads", str(threads)]
        out["Transformers plain float32"] = (hf, {})
        draft = ["--draft", str(BUNDLE / "dmtp"), "--mtp-head", str(BUNDLE / "mtp_head")]
        out["dmtp-hf DMTP float32"] = ([*hf, *draft], {})
    return out


def policy_choices(answers: list[dict]) -> dict | None:
    """What the adaptive policy chose over a method's answers (each job's counters): the mean verified width per
    request-step, the share of plain steps, the share of request-steps that took prompt lookup."""
    reports = [a.get("policy") for a in answers]
    if not reports or reports[0] is None:
        return None
    totals = {"steps": 0, "plain_steps": 0, "rows": 0, "lookup_rows": 0, "verified": 0}
    for report in reports:
        for key in totals:
            totals[key] += report[key]
    rows, steps = max(totals["rows"], 1), max(totals["steps"], 1)
    return {
        "mean_verified_width": totals["verified"] / rows,
        "plain_step_share": totals["plain_steps"] / steps,
        "lookup_share": totals["lookup_rows"] / rows,
        "steps": totals["steps"],
    }


def export_drafts(target: str, out: Path) -> None:
    """The bundled DMTP (with its head) and DFlash drafts as vLLM folders."""
    common = ["--target", target]
    dmtp = [sys.executable, "-m", "dmtp_hf.cli", "convert"]
    head = ["--mtp-head", str(BUNDLE / "mtp_head")]
    subprocess.run([*dmtp, str(BUNDLE / "dmtp"), str(out / "dmtp"), "--to", "vllm", *head, *common], check=True)
    subprocess.run([*dmtp, str(BUNDLE / "dflash"), str(out / "dflash"), "--to", "dflash", *common], check=True)


def summarize(answers: list[dict], plain: list[dict]) -> dict:
    """Acceptance and timing of one method over one set's concurrency-1 answers."""
    drafts = sum(a["drafts"] for a in answers)
    accepted = sum(a["accepted"] for a in answers)
    first = sum(a["per_pos"][0] for a in answers if a["per_pos"])
    tokens = sum(len(t) for a in answers for t in a["tokens"])
    per_request = [1 + a["accepted"] / a["drafts"] for a in answers if a["drafts"]]
    return {
        "requests": len(answers),
        "lossless": all(a["tokens"] == p["tokens"] for a, p in zip(answers, plain, strict=True)),
        "tau_per_verify": 1 + accepted / drafts if drafts else None,
        "tau_per_request": statistics.mean(per_request) if per_request else None,
        "first_candidate_acceptance": first / drafts if drafts else None,
        "tokens_per_second": tokens / sum(a["seconds"] for a in answers),
        "speedup_vs_plain": spread([p["seconds"] / a["seconds"] for a, p in zip(answers, plain, strict=True)]),
        "policy": policy_choices(answers),
    }


def main() -> None:
    """Run the comparison and write ``results.json`` (the README table comes from it: ``report.py``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(Path.home() / ".cache" / "dmtp_hf" / "smollm2"))
    parser.add_argument("--limit", type=int, default=10, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="4,16")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved passes over the concurrency-1 prompts")
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled default (minutes per engine start)")
    parser.add_argument("--output", type=Path, default=REPO / "reports" / "vllm" / "results.json")
    parser.add_argument(
        "--cores",
        default=f"0-{os.cpu_count() - 1}",
        help="the cores every worker runs on (1: leave core 0 to a training job); one thread per core in each engine",
    )
    args = parser.parse_args()
    cores = parse_cores(args.cores)
    drafts = REPO / "outputs" / "vllm" / "drafts"  # exported fp32 folders (tens of MB): not committed
    export_drafts(args.target, drafts)
    build_held_out_sets()
    sets = load_prompts(AutoTokenizer.from_pretrained(args.target), args.limit, args.max_tokens)
    previous = json.loads(args.output.read_text()) if args.output.is_file() else {}
    settings = vars(args) | {"output": str(args.output), "cpu_count": os.cpu_count(), "eager": not args.compiled}
    results: dict = {"settings": {}, "runs": previous.get("runs", {}), "wall_seconds": {}}
    for key in ("settings", "wall_seconds"):  # per dtype, for the dtypes kept
        stored = previous.get(key)
        if isinstance(stored, dict) and "dtypes" in stored:  # one run's settings: they are its dtypes'
            stored = dict.fromkeys(stored["dtypes"].split(","), stored)
        if isinstance(stored, dict):
            results[key] = {d: v for d, v in stored.items() if d in results["runs"]}
    for dtype in args.dtypes.split(","):
        started = time.time()
        workers = {}
        for label, (command, extra) in methods(args.target, drafts, dtype, len(cores), not args.compiled).items():
            print(f"starting {label}", flush=True)
            env = vllm_env(cores) if command[0] == str(VLLM_PYTHON) else dict(os.environ)
            workers[label] = Worker(label, command, env | extra, cores)
        per_set = {}
        for name, prompts in sets.items():
            print(f"{dtype} {name}: {len(prompts)} prompts", flush=True)
            answers = interleaved(workers, [[p] for p in prompts], args.repeats)
            per_set[name] = {}
            for label in workers:
                per_set[name][label] = summarize(answers[label], answers[plain_label(label, dtype)])
        batches = {}
        pool = [p for prompts in sets.values() for p in prompts]
        vllm_workers = {k: w for k, w in workers.items() if k.startswith("vLLM")}
        for size in map(int, args.batch_sizes.split(",")):
            jobs = [pool[i : i + size] for i in range(0, len(pool) - size + 1, size)][: args.batch_repeats]
            if not jobs:
                continue
            answers = interleaved(vllm_workers, jobs)
            plain = answers[f"vLLM plain {dtype}"]
            batches[size] = {
                label: {
                    "lossless": all(a["tokens"] == p["tokens"] for a, p in zip(got, plain, strict=True)),
                    "tokens_per_second": spread([sum(map(len, a["tokens"])) / a["seconds"] for a in got]),
                    "speedup_vs_plain": spread([p["seconds"] / a["seconds"] for a, p in zip(got, plain, strict=True)]),
                    "tau_per_verify": 1 + sum(a["accepted"] for a in got) / max(1, sum(a["drafts"] for a in got)),
                    "policy": policy_choices(got),
                }
                for label, got in answers.items()
            }
        for worker in workers.values():
            worker.close()
        results["runs"][dtype] = {"concurrency_1": per_set, "batches": batches}
        results["settings"][dtype] = settings
        results["wall_seconds"][dtype] = time.time() - started
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {dtype} to {args.output} in {results['wall_seconds'][dtype] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
