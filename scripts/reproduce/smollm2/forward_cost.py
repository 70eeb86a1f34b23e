"""What one target forward costs per number of new tokens, on this machine: the price of a verify of each width.

On some CPUs a one-token decoding step takes a fast path (a matrix-vector product) that any multi-token forward
leaves, so even a 2-token verify costs much more than a step and no drafter can win at batch size 1; on others a
verify of 8 tokens costs little more than a step. This prints the median time of one forward over N new tokens after
a fixed prefix, at batch sizes 1 and 2, so a `dmtp bench` table can be read against the machine it ran on.
`scripts/bench_compiled_verify.py` times the same eager forward at B = 1 next to a compiled one, but needs a draft
and compiles every width (minutes on a CPU); this is the eager-only check, per batch size, in seconds.

    python scripts/reproduce/smollm2/forward_cost.py                 # the SmolLM2 target, two threads
    python scripts/reproduce/smollm2/forward_cost.py --threads 1 --widths 1,2,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from dmtp_hf.bundled.smollm2 import default_directory


def forward_milliseconds(model, batch_size: int, prefix: int, widths: list[int], repeats: int) -> dict[int, float]:
    """Median milliseconds of one forward over each width of new tokens after a `prefix`-token cache."""
    vocab = model.config.vocab_size
    cache = DynamicCache()
    model(torch.randint(0, vocab, (batch_size, prefix)), cache=cache, use_cache=True)
    costs = {}
    for width in widths:
        new_tokens = torch.randint(0, vocab, (batch_size, width))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(new_tokens, cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-width)  # back to the prefix, so every repeat sees the same context
        costs[width] = round(1000 * statistics.median(times), 1)
    return costs


def main(argv: list[str] | None = None) -> int:
    """Print (and with --output write) the forward cost per width and batch size as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder (default: the SmolLM2 target set up here)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=256, help="tokens already in the cache")
    parser.add_argument("--widths", default="1,2,5,8", help="new tokens per forward (1 = a decoding step)")
    parser.add_argument("--batch-sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    target = args.target or str(default_directory())
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    widths = [int(w) for w in args.widths.split(",")]
    result = {"target": target, "threads": args.threads, "prefix": args.prefix, "milliseconds": {}}
    with torch.inference_mode():
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            costs = forward_milliseconds(model, batch_size, args.prefix, widths, args.repeats)
            result["milliseconds"][f"B={batch_size}"] = costs
            step = costs.get(1)
            ratios = ", ".join(
                f"{w}: {ms} ms" + (f" ({ms / step:.2f} steps)" if step else "") for w, ms in costs.items()
            )
            print(f"B = {batch_size}: {ratios}", flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
