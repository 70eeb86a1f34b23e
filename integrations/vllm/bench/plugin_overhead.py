"""What installing dmtp-vllm costs an engine that does not use DMTP: vLLM plain decoding with the plugin loaded
against the same engine with ``VLLM_PLUGINS=none``, both alive, jobs interleaved (the order alternating), on the
same prompts. Prints and writes the per-job ratio (time without the plugin / time with it: 1.00 means no cost) with
its median and spread; the tokens must be identical.

    .venv-vllm/bin/python integrations/vllm/bench/plugin_overhead.py            # after `make test-vllm`

Standard library only (``make test-vllm`` calls `measure` from vLLM's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers import HERE, REPO, VLLM_PYTHON, Worker, interleaved, parse_cores, spread, vllm_env  # noqa: E402

DATA = REPO / "src" / "dmtp_hf" / "evaluation" / "data"


def measure(target: str, prompts: list[dict], rounds: int, cores: set[int], eager: bool = True) -> dict:
    """Plain decoding of ``prompts`` (one per job) with and without the plugin, ``rounds`` interleaved passes."""
    command = [str(VLLM_PYTHON), str(HERE / "vllm_worker.py"), "--target", target, "--max-num-seqs", "4"]
    command += ["--eager"] if eager else []
    workers = {
        "plugin": Worker("plugin", command, vllm_env(cores, plugins=True), cores),
        "none": Worker("none", command, vllm_env(cores, plugins=False), cores),
    }
    try:
        answers = interleaved(workers, [[p] for p in prompts], rounds)
    finally:
        for worker in workers.values():
            worker.close()
    with_plugin, without = answers["plugin"], answers["none"]
    tokens = sum(len(t) for a in with_plugin for t in a["tokens"])
    return {
        "jobs": len(with_plugin),
        "identical": all(a["tokens"] == b["tokens"] for a, b in zip(with_plugin, without, strict=True)),
        "ratio": spread([b["seconds"] / a["seconds"] for a, b in zip(with_plugin, without, strict=True)]),
        "tokens_per_second": {
            "plugin": tokens / sum(a["seconds"] for a in with_plugin),
            "none": tokens / sum(b["seconds"] for b in without),
        },
        "eager": eager,
        # per job, in the order they ran: a compiled engine's first jobs pay torch.compile for their new shapes
        "seconds": {"plugin": [a["seconds"] for a in with_plugin], "none": [b["seconds"] for b in without]},
    }


def chat_prompts(
    target: str, count: int, max_tokens: int, names: tuple[str, ...] = ("gsm8k", "humaneval", "mt_bench")
) -> list[dict]:
    """First user turns of the bundled sets ``names`` (GSM8K, HumanEval and MT-Bench), in turn, as chat-template
    token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    sets = []
    for name in names:
        with open(DATA / f"{name}.jsonl") as f:
            sets.append([json.loads(line)["turns"][0] for line in f])
    texts = [sets[i % len(sets)][i // len(sets)] for i in range(count)]
    messages = [[{"role": "user", "content": text}] for text in texts]
    return [
        {
            "prompt_token_ids": tokenizer.apply_chat_template(
                m, add_generation_prompt=True, tokenize=True, return_dict=False
            ),
            "max_tokens": max_tokens,
        }
        for m in messages
    ]


def main() -> None:
    """Measure, print, write ``reports/vllm/plugin_overhead.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(Path.home() / ".cache" / "dmtp_hf" / "smollm2"))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled default instead of eager engines")
    parser.add_argument("--cores", default=f"0-{os.cpu_count() - 1}")
    parser.add_argument("--output", type=Path, default=REPO / "reports" / "vllm" / "plugin_overhead.json")
    args = parser.parse_args()
    started = time.time()
    result = measure(
        args.target,
        chat_prompts(args.target, args.prompts, args.max_tokens),
        args.rounds,
        parse_cores(args.cores),
        eager=not args.compiled,
    )
    result["settings"] = {k: str(v) for k, v in vars(args).items()}
    result["wall_seconds"] = time.time() - started
    ratio = result["ratio"]
    print(
        f"plain with the plugin / without: x{ratio['median']:.3f} "
        f"(min {ratio['min']:.3f}, max {ratio['max']:.3f}) over "
        f"{result['jobs']} interleaved jobs; tok/s {result['tokens_per_second']['plugin']:.1f} with, "
        f"{result['tokens_per_second']['none']:.1f} without; identical tokens: {result['identical']}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
