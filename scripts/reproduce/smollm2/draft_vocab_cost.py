"""What a draft vocabulary buys on SmolLM2-135M-Instruct: LM-head cost per round, coverage, training step time.

    .venv/bin/python scripts/reproduce/smollm2/draft_vocab_cost.py --output reports/smollm2/draft_vocab.json

1. Cost per round of the draft logits (DFlash: 7 slots; the MTP head: T1, one row) over the full 49,152-token
   vocabulary and over frequency-ranked subsets, next to a target decode step (median of repeated timings).
2. Coverage: the subsets are built from a seeded 90 % of the regenerated answers; the share of the other 10 %'s
   answer tokens inside each subset is what a draft over it can at best predict.
3. Training step time (DFlash draft and retrofitted MTP head, micro-batch 8, offline features of the first
   regenerated records): full vocabulary against the subset, the mean of the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[3]


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def answers(paths: list[Path], tokenizer) -> list[list[int]]:
    """The token ids of every assistant turn of the regenerated records."""
    streams = []
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            for message in record["messages"]:
                if message["role"] == "assistant":
                    streams.append(tokenizer(message["content"], add_special_tokens=False)["input_ids"])
    return streams


def head_costs(target, sizes: list[int], ranked: list[int], repeats: int) -> dict:
    """Milliseconds of a target decode step, and of the draft (7 slots) and MTP-head (T1) logits per subset size."""
    from dmtp_hf.modeling.draft_vocab import draft_logits, register_draft_vocabulary, set_draft_vocabulary
    from dmtp_hf.modeling.native_mtp import new_mtp_head

    hidden = target.config.hidden_size
    draft_rows, head_rows = torch.randn(1, 7, hidden), torch.randn(1, hidden)
    step_ids = torch.randint(0, 1000, (1, 200))
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=step_ids, cache=cache, use_cache=True)

        def decode_step():
            target(input_ids=step_ids[:, :1], cache=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)

        out = {"target_decode_step_ms": median_ms(decode_step, repeats)}
        head = new_mtp_head(target)
        lm_head = target.get_output_embeddings()
        for size in [None, *sizes]:
            label = "full" if size is None else str(size)
            holder = torch.nn.Module()
            holder.config = type("C", (), {"dflash_config": {}})()
            register_draft_vocabulary(holder, size, target.config.vocab_size)
            head.use_draft_vocabulary(size)
            if size is not None:
                set_draft_vocabulary(holder, ranked[:size])
                set_draft_vocabulary(head, ranked[:size])
            out[label] = {
                "draft_7_slots_ms": median_ms(lambda h=holder: draft_logits(h, lm_head, draft_rows), repeats),
                "mtp_t1_ms": median_ms(lambda: head.logits(head_rows), repeats),
            }
    return out


def step_times(config_path: Path, features: Path, size: int, steps: int) -> dict:
    """Mean seconds per optimizer step (after the first) of the config's training, full vocabulary vs ``size``."""
    from dmtp_hf.training import TrainConfig, Trainer

    results = {}
    for label, vocab in (("full", None), (str(size), size)):
        values = yaml.safe_load(config_path.read_text())
        values.update(
            train_data=str(features),
            max_steps=steps,
            eval_holdout=0,
            eval_every=0,
            save_every=10**6,
            report_to="none",
            log_every=1,
            warmup_ratio=0.0,
        )
        if values.get("train_mtp_head") == "only":
            values["mtp_draft_vocab_size"] = vocab
        else:
            values["draft_config"] = {**values["draft_config"], "draft_vocab_size": vocab}
        with tempfile.TemporaryDirectory() as tmp:
            values["output_dir"] = tmp
            trainer = Trainer(TrainConfig.from_dict(values))
            stamps = []
            original = trainer.optimizer.step

            def timed_step(*args, step=original, times=stamps, **kwargs):
                result = step(*args, **kwargs)
                times.append(time.perf_counter())
                return result

            trainer.optimizer.step = timed_step
            trainer.train()
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        results[label] = {"step_seconds": statistics.mean(gaps), "steps_timed": len(gaps)}
    return results


def main() -> None:
    """Measure, print and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(ROOT / "outputs/smollm2/target"))
    parser.add_argument("--regenerated", default=str(ROOT / "outputs/smollm2/regenerated"))
    parser.add_argument(
        "--features",
        default=str(ROOT / "outputs/smollm2/features_probe"),
        help="offline features for the step timing (made here from 64 records if absent)",
    )
    parser.add_argument("--sizes", default="4096,8192,12288,16384")
    parser.add_argument("--train-size", type=int, default=8192, help="the subset the step timing uses")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--coverage-only", action="store_true", help="only the coverage (no timing)")
    parser.add_argument("--output", default=str(ROOT / "reports/smollm2/draft_vocab.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    from transformers import AutoTokenizer

    from dmtp_hf.assistant.target.loading import load_target
    from dmtp_hf.modeling.draft_vocab import frequency_ranked_vocabulary

    sizes = [int(s) for s in args.sizes.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    files = sorted(Path(args.regenerated).glob("train_*.jsonl"))
    files = [f for f in files if f.name != "train_all.jsonl"]
    per_set = {f.stem.removeprefix("train_"): answers([f], tokenizer) for f in files}
    train, heldout_per_set = [], {}
    for name, streams in per_set.items():  # 10 % of each set held out (seeded)
        random.Random(0).shuffle(streams)
        held = len(streams) // 10
        train += streams[held:]
        heldout_per_set[name] = streams[:held]
    heldout = [s for streams in heldout_per_set.values() for s in streams]
    eos = [tokenizer.eos_token_id]
    vocab = len(tokenizer)
    ranked, _ = frequency_ranked_vocabulary(train, max(sizes), vocab, eos)  # the first n of it: the n-subset

    def share(subset: set[int], streams: list[list[int]]) -> float:
        return sum(t in subset for s in streams for t in s) / max(1, sum(len(s) for s in streams))

    coverage, coverage_per_set = {}, {}
    for size in sizes:
        subset = set(ranked[:size])
        coverage[str(size)] = share(subset, heldout)
        coverage_per_set[str(size)] = {name: share(subset, streams) for name, streams in heldout_per_set.items()}
    print("coverage of held-out answer tokens:", json.dumps(coverage_per_set, indent=1))
    result = {
        "answers": {"train": len(train), "heldout": len(heldout), "files": [f.name for f in files]},
        "distinct_train_tokens": len({t for s in train for t in s}),
        "coverage_heldout": coverage,
        "coverage_heldout_per_set": coverage_per_set,
        "threads": args.threads,
        "command": "python scripts/reproduce/smollm2/draft_vocab_cost.py " + " ".join(sys.argv[1:]),
    }
    if args.coverage_only:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.output)
        return

    target = load_target(args.target, dtype=torch.float32)
    costs = head_costs(target, sizes, ranked, args.repeats)
    print("LM-head cost per round (ms):", json.dumps(costs, indent=1))

    features = Path(args.features)
    if not (features / "index.json").is_file():
        probe = features.parent / "features_probe.jsonl"
        probe.write_text("".join(files[0].read_text().splitlines(keepends=True)[:64]))
        from dmtp_hf.cli import main as dmtp

        dmtp(
            [
                "extract",
                "--target",
                args.target,
                "--data",
                str(probe),
                "--output",
                str(features),
                "--target-layer-ids",
                "1,14,27",
                "--no-mtp",
                "--head-inputs",
                "--max-length",
                "384",
                "--batch-size",
                "8",
                "--shard-size",
                "64",
                "--dtype",
                "bfloat16",
            ]
        )
    steps = {
        "dflash": step_times(ROOT / "configs/smollm2-dflash.yaml", features, args.train_size, args.steps),
        "mtp_head": step_times(ROOT / "configs/smollm2-mtp-head.yaml", features, args.train_size, args.steps),
    }
    print("training step time:", json.dumps(steps, indent=1))
    result.update(lm_head_ms=costs, train_step=steps)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.output)


if __name__ == "__main__":
    main()
