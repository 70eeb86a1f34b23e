"""A compiled verify forward against eager, per width and end to end (warm-up included), in one run.

Part 1: one target forward over 1..W tokens after a fixed-length context, eager (dynamic cache, what the engine runs
by default) and compiled (static cache, Transformers' `get_compiled_call` with the configuration
`compile=True` picks on this device), medians of --repeats, plus the one-off compile time per width.
Part 2: a --max-new-tokens generation from each of --prompts prompts, four ways: plain `generate` eager, plain
`generate` compiled (static cache, compiled one-token step), speculative eager and speculative with a compiled verify.
The first prompt's time includes compilation; the rest are warm. Every speculative output is checked against plain.

    python scripts/bench_compiled_verify.py                                # the bundled target and DMTP draft
    python scripts/bench_compiled_verify.py --target DIR --draft DIR --output reports/performance/compiled.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicCache, StaticCache

from dmtp_hf import DMTPDraftModel
from dmtp_hf.assistant.generate import compiled_verify_config
from dmtp_hf.assistant.generate import generate as dmtp_generate
from dmtp_hf.assistant.target.cache import crop_attention

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "dmtp_hf_assets" / "models"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue in two sentences.",
    "Write a function that checks whether a string is a palindrome.",
    "What is 17 times 23? Show your steps.",
    "Write a Python function that merges two sorted lists.",
    "Give three tips for staying focused while studying.",
]


def _timed(call, **kwargs) -> float:
    start = time.perf_counter()
    call(**kwargs)
    return time.perf_counter() - start


def _timed_static(call, cache, **kwargs) -> float:
    seconds = _timed(call, cache=cache, **kwargs)
    for layer in cache.layers:  # attention back to the context: the next call rewrites the same slots (linear
        crop_attention(layer, kwargs["input_ids"].shape[1])  # states just advance, which costs the same)
    return seconds


def forward_costs(target, widths: list[int], context: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of one forward over each width after ``context`` tokens: eager, compiled, compile time."""
    compiled = target.get_compiled_call(compiled_verify_config(target, True))
    prompt = torch.randint(10, target.config.get_text_config().vocab_size, (1, context))
    rows: dict[str, dict[str, float]] = {"eager": {}, "compiled": {}, "compile_seconds": {}}
    static = StaticCache(config=target.config, max_cache_len=context + max(widths) + 1)
    with torch.no_grad():
        target(input_ids=prompt, cache=static, use_cache=True, logits_to_keep=1)
        for width in widths:
            step = {
                "input_ids": prompt[:, :width],
                "position_ids": torch.arange(context, context + width)[None],
                "use_cache": True,
            }
            rows["compile_seconds"][str(width)] = _timed_static(compiled, static, **step)
            _timed_static(compiled, static, **step)
            eager = []
            for _ in range(repeats):
                cache = DynamicCache(config=target.config)  # every eager timing after the same context
                target(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
                eager.append(_timed(target, cache=cache, **step))
            rows["eager"][str(width)] = statistics.median(eager)
            rows["compiled"][str(width)] = statistics.median(
                _timed_static(compiled, static, **step) for _ in range(repeats)
            )
            print(
                f"width {width}: eager {1e3 * rows['eager'][str(width)]:.2f} ms, compiled "
                f"{1e3 * rows['compiled'][str(width)]:.2f} ms (compile {rows['compile_seconds'][str(width)]:.0f} s)",
                flush=True,
            )
    return rows


def end_to_end(target, draft, tokenizer, prompts: list[str], max_new_tokens: int) -> dict[str, dict]:
    """Seconds per prompt of the four ways to generate; the first prompt pays for compilation."""
    compile_plain = compiled_verify_config(target, True)
    compile_plain._compile_all_devices = True  # Transformers compiles decoding on CUDA only unless told to
    common = {"do_sample": False, "max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens}
    ways = {
        "plain": lambda ids: target.generate(ids, **common),
        "plain_compiled": lambda ids: target.generate(
            ids, cache_implementation="static", compile_config=compile_plain, **common
        ),
        "speculative": lambda ids: dmtp_generate(target, ids, draft, **common),
        "speculative_compiled": lambda ids: dmtp_generate(target, ids, draft, compile=True, **common),
    }
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for text in prompts
    ]
    results, references = {name: {"seconds": [], "identical": True} for name in ways}, []
    # One way at a time over every prompt: a compiled forward shared by two ways (the same CompileConfig) would
    # otherwise recompile each time they alternate (cache sizes and the MTP-hidden hook are guarded on).
    for name, run in ways.items():
        torch._dynamo.reset()  # each way compiles its own graphs, as in a process of its own
        for index, ids in enumerate(encoded):
            start = time.perf_counter()
            with torch.no_grad():
                out = run(ids)
            results[name]["seconds"].append(time.perf_counter() - start)
            if name == "plain":
                references.append(out)
            results[name]["identical"] &= bool(torch.equal(out, references[index]))
            print(f"{name} prompt {index}: {results[name]['seconds'][-1]:.2f} s", flush=True)
    tokens = max_new_tokens * len(prompts)
    for row in results.values():
        row["first_seconds"] = row["seconds"][0]
        warm = row["seconds"][1:] or row["seconds"]
        row["warm_tokens_per_second"] = max_new_tokens * len(warm) / sum(warm)
        row["tokens_per_second_with_warmup"] = tokens / sum(row["seconds"])
    return results


def main() -> None:
    """Run both parts, print the tables, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=BUNDLED / "target")
    parser.add_argument("--draft", type=Path, default=BUNDLED / "dmtp")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--keep-compile-cache",
        action="store_true",
        help="reuse inductor's on-disk cache (default: a fresh one, so compile times are cold)",
    )
    parser.add_argument("--skip-forward", action="store_true", help="only the end-to-end part")
    parser.add_argument("--output", type=Path, default=Path("outputs/compiled_verify.json"))
    args = parser.parse_args()
    if not args.keep_compile_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    draft = DMTPDraftModel.from_pretrained(args.draft).bind(target)
    widths = [int(w) for w in args.widths.split(",")]
    report = {
        "target": str(args.target),
        "draft": str(args.draft),
        "threads": torch.get_num_threads(),
        "compile_config": compiled_verify_config(target, True).to_dict(),
        "max_new_tokens": args.max_new_tokens,
        "cold_compile": not args.keep_compile_cache,
    }
    if not args.skip_forward:
        report["forward"] = forward_costs(target, widths, args.context, args.repeats)
        torch._dynamo.reset()
    report["end_to_end"] = end_to_end(target, draft, tokenizer, PROMPTS[: args.prompts], args.max_new_tokens)
    print("\n| way | first prompt (s, incl. compile) | warm tok/s | × plain (warm) | tok/s incl. warm-up | identical |")
    print("|---|---|---|---|---|---|")
    base = report["end_to_end"]["plain"]["warm_tokens_per_second"]
    for name, row in report["end_to_end"].items():
        print(
            f"| {name} | {row['first_seconds']:.1f} | {row['warm_tokens_per_second']:.1f} | "
            f"{row['warm_tokens_per_second'] / base:.2f}× | {row['tokens_per_second_with_warmup']:.1f} | "
            f"{row['identical']} |"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
