"""GPU check, one shot: versions, CUDA-graph replay equals eager, per-stage round costs, tokens/s; fails loudly.

A GPU is lent for minutes, once. This script is the whole visit:

    python -u scripts/gpu_check.py                                 # bundled models, then a random 2048x12 bf16 target
    python -u scripts/gpu_check.py --budget-seconds 300            # size the work to the slot
    python -u scripts/gpu_check.py --device cpu --targets bundled --prompts 2 --max-new-tokens 16   # CPU dry run

For each target (``--targets``: ``bundled`` = the bundled Qwen3.5-style target and drafts; ``random:HxL`` = a random
Qwen3.5-architecture target in the blog's shape with random drafts, timings only), in this order:

1. **correctness**: every prompt and fast-path drafter (DMTP, DFlash, MTP-1) gives the same tokens with CUDA graphs
   as eagerly, every graph was captured once and replayed, no capture failed or fell back; how many prompts also
   equal plain ``generate`` (exact in fp32; in bf16 near-ties may flip, which is reported, not hidden);
2. **stages**: ms per round of each stage (synchronised), the whole round, the MTP + T1 share of a DMTP round;
3. **throughput**: tokens/s of plain ``generate`` and of each drafter (graphs captured before the timing; capture
   time reported on its own).

The JSON report (``--output``) is rewritten after every section, and printing is unbuffered, so a timeout loses
nothing already measured. Exit code 1 if any check failed (or a section could not run).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from dmtp_hf import DMTPConfig, DMTPDraftModel
from dmtp_hf.assistant import DFlashDrafter, DMTPDrafter, MTPDrafter, SpecStats
from dmtp_hf.assistant.generate import generate
from dmtp_hf.assistant.stats import ROUND_STAGES
from dmtp_hf.assistant.target.loading import load_target
from dmtp_hf.evaluation.models import eos_token_ids, load_tokenizer
from dmtp_hf.evaluation.prompts import load_bundled_set

STAGE_TITLES = {
    "dflash": "fusion + DFlash forward + candidates",
    "mtp": "MTP advance",
    "t1": "T1 head + selection",
    "mtp_step": "chained MTP steps (MTP-k)",
    "verify": "target verify + acceptance",
    "rollback": "target rollback",
    "commit": "commit (bookkeeping, host sync)",
}


def versions() -> dict[str, str | None]:
    """torch, transformers, flash-attn, FLA, causal-conv1d, the GPU."""
    found = {}
    for package in ("torch", "transformers", "accelerate", "flash-attn", "flash-linear-attention", "causal-conv1d"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    found["cuda"] = torch.version.cuda
    found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_draft(target, layout: str) -> DMTPDraftModel:
    """A 2-layer random draft for ``target`` (timings and graph checks need no trained weights)."""
    text = target.config.get_text_config()
    layers = text.num_hidden_layers
    config = DMTPConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=3 * text.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=max(1, text.hidden_size // 128),
        num_key_value_heads=max(1, text.hidden_size // 512),
        head_dim=128 if text.hidden_size >= 128 else text.hidden_size,
        num_target_layers=layers,
        target_layer_ids=[1, layers - 2] if layers > 3 else [0, layers - 1],
        mask_token_id=text.vocab_size - 1,
        anchor_layout=layout,
        fusion="none" if layout == "dflash" else "residual",
    )
    torch.manual_seed(0)
    return DMTPDraftModel(config)


def load_models(spec: str, device: torch.device, dtype: torch.dtype, workdir: Path):
    """(target, tokenizer, dmtp draft, dflash draft, description) for ``bundled`` or ``random:HxL``."""
    if spec.startswith("random:"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_round_cost import build_random_target

        hidden, layers = (int(v) for v in spec.removeprefix("random:").lower().split("x"))
        target = build_random_target(hidden, layers, 32768, workdir / spec.replace(":", "_"))
        target = target.to(device=device, dtype=dtype).eval()
        drafts = {name: random_draft(target, layout) for name, layout in (("dmtp", "dual"), ("dflash", "dflash"))}
        description = f"random Qwen3.5-architecture target, hidden {hidden}, {layers} layers; random drafts"
        tokenizer = None
    elif spec == "bundled":
        from dmtp_hf.bundled import default_paths

        paths = default_paths(("target", "dmtp", "dflash"))
        target = load_target(paths["target"], dtype=dtype, device=device)
        tokenizer = load_tokenizer(str(paths["target"]))
        drafts = {name: DMTPDraftModel.from_pretrained(paths[name]) for name in ("dmtp", "dflash")}
        description = "bundled target and trained drafts"
    else:
        raise SystemExit(f"unknown target {spec!r}: use bundled or random:HxL")
    dmtp, dflash = (drafts[n].to(device=device, dtype=dtype).eval().bind(target) for n in ("dmtp", "dflash"))
    dmtp.native_mtp.to(device=device, dtype=dtype)  # read the MTP tensors while the checkpoint exists
    return target, tokenizer, dmtp, dflash, description


def build_prompts(tokenizer, count: int, vocab: int, device: torch.device) -> list[torch.Tensor]:
    """First turns of MT-Bench and HumanEval through the chat template (random ids for a random target)."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(4, vocab, (1, 64), generator=generator).to(device) for _ in range(count)]
    prompts = []
    for name in ("mt_bench", "humaneval"):
        for prompt in load_bundled_set(name, limit=(count + 1) // 2).prompts:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.turns[0]}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            prompts.append(tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device))
    return prompts[:count]


def run(target, prompt, drafter, kwargs, profile=False):
    """One speculative generate: (new tokens, stats)."""
    out = generate(target, prompt, drafter, profile=profile, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, prompt.shape[1] :], out.spec_stats


def drafters(dmtp, dflash, fixed: bool = True, graphs: bool = True) -> dict:
    """The fast-path drafters compared (``fixed=False``: the dynamic DMTP drafter)."""
    return {
        "dmtp": DMTPDrafter(dmtp, dmtp.native_mtp, fixed_shapes=fixed, cuda_graphs=graphs),
        "dflash": DFlashDrafter(dflash, fixed_shapes=fixed, cuda_graphs=graphs),
        "mtp1": MTPDrafter(dmtp.native_mtp, 1, fixed_shapes=fixed, cuda_graphs=graphs),
    }


def graph_report(drafter) -> dict:
    """Captures, replays, capture seconds and failures of a drafter's graphed stages."""
    calls = drafter.graph_calls()
    return {
        "captures": sum(c.captures for c in calls),
        "replays": sum(c.replays for c in calls),
        "capture_seconds": sum(c.capture_seconds for c in calls),
        "failures": [c.failure for c in calls if c.failure],
    }


def check_correctness(models, prompts, kwargs, device) -> tuple[dict, int]:
    """Section 1: graph replay == eager, graphs replayed, no fallback; agreement with plain generate."""
    target, _, dmtp, dflash, _ = models
    eager, graphed = drafters(dmtp, dflash, graphs=False), drafters(dmtp, dflash, graphs=True)
    results, failures = {}, 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        references = [target.generate(p, **kwargs)[0, p.shape[1] :] for p in prompts]
        for name in eager:
            same_eager = same_generate = 0
            for prompt, reference in zip(prompts, references):
                tokens_eager, _ = run(target, prompt, eager[name], kwargs)
                tokens_graph, _ = run(target, prompt, graphed[name], kwargs)
                same_eager += torch.equal(tokens_eager, tokens_graph)
                same_generate += torch.equal(tokens_graph, reference)
            graphs = graph_report(graphed[name])
            replayed = device.type != "cuda" or (graphs["replays"] > 0 and not graphs["failures"])
            ok = same_eager == len(prompts) and replayed
            failures += not ok
            results[name] = {
                "graph_equals_eager": same_eager,
                "equals_generate": same_generate,
                "prompts": len(prompts),
                "graphs": graphs,
                "ok": ok,
            }
            print(
                f"[{'PASS' if ok else 'FAIL'}] {name}: graph == eager on {same_eager}/{len(prompts)} prompts, "
                f"== plain generate on {same_generate}/{len(prompts)}; graphs {graphs}",
                flush=True,
            )
    fallbacks = [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)]
    if fallbacks:
        failures += 1
        print(f"[FAIL] a capture fell back to eager: {fallbacks}", flush=True)
    results["fallback_warnings"] = fallbacks
    return results, failures


def measure_stages(models, prompts, kwargs) -> dict:
    """Section 2: synchronised ms per round of every stage, for each method."""
    target, _, dmtp, dflash, _ = models
    fast = drafters(dmtp, dflash)
    methods = {
        "dflash (fast)": fast["dflash"],
        "dmtp (dynamic, eager)": DMTPDrafter(dmtp, dmtp.native_mtp),
        "dmtp (fast)": fast["dmtp"],
        "mtp1 (fast)": fast["mtp1"],
    }
    rows = {}
    with torch.no_grad():
        for label, drafter in methods.items():
            run(target, prompts[0], drafter, kwargs, profile=True)  # warm-up: graphs captured here, once
            stats = SpecStats(drafter.num_candidates, label)
            for prompt in prompts:
                stats.merge(run(target, prompt, drafter, kwargs, profile=True)[1])
            rounds = max(stats.num_rounds, 1)
            row = {key: 1000 * stats.stage_seconds.get(key, 0.0) / rounds for key in ROUND_STAGES}
            row["round"] = 1000 * stats.stage_seconds.get("rounds", 0.0) / rounds
            row["stage_sum"] = sum(row[key] for key in ROUND_STAGES)
            row["mtp_t1_share"] = (row["mtp"] + row["t1"] + row["mtp_step"]) / row["round"] if row["round"] else 0.0
            row["acceptance_length"] = stats.acceptance_length_per_verify
            row["capture_seconds"] = graph_report(drafter)["capture_seconds"]
            rows[label] = row
    print(f"\n{'stage (ms/round)':36s}" + "".join(f"{label:>24s}" for label in rows))
    for key, title in [
        *STAGE_TITLES.items(),
        ("round", "whole round"),
        ("stage_sum", "sum of stages"),
        ("mtp_t1_share", "MTP + T1 share of the round"),
        ("acceptance_length", "tokens per round"),
        ("capture_seconds", "graph capture (s, once)"),
    ]:
        cells = [f"{100 * r[key]:23.1f}%" if key == "mtp_t1_share" else f"{r[key]:24.3f}" for r in rows.values()]
        print(f"{title:36s}" + "".join(cells), flush=True)
    return rows


def measure_throughput(models, prompts, kwargs, device) -> dict:
    """Section 3: tokens/s, no synchronisation inside rounds, graphs captured by a warm-up run."""
    target, _, dmtp, dflash, _ = models
    fast = drafters(dmtp, dflash)
    contenders = {
        "generate": None,
        "dmtp (dynamic)": DMTPDrafter(dmtp, dmtp.native_mtp),
        **{f"{name} (fast)": drafter for name, drafter in fast.items()},
    }
    throughput = {}
    with torch.no_grad():
        for label, drafter in contenders.items():
            if drafter is None:
                target.generate(prompts[0], **kwargs)
            else:
                run(target, prompts[0], drafter, kwargs)
            _sync(device)
            start, tokens = time.perf_counter(), 0
            for prompt in prompts:
                if drafter is None:
                    tokens += target.generate(prompt, **kwargs).shape[1] - prompt.shape[1]
                else:
                    tokens += run(target, prompt, drafter, kwargs)[0].shape[0]
            _sync(device)
            throughput[label] = tokens / (time.perf_counter() - start)
    base = throughput["generate"]
    print(f"\n{'method':26s}{'tokens/s':>12s}{'vs generate':>14s}")
    for label, value in throughput.items():
        print(f"{label:26s}{value:12.1f}{value / base:13.2f}x", flush=True)
    return throughput


def main(argv: list[str] | None = None) -> int:
    """Run every section for every target; exit code 1 if any check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="bundled,random:2048x12", help="comma list: bundled, random:HxL")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget-seconds", type=float, default=420.0, help="stop starting sections after this")
    parser.add_argument("--output", type=Path, default=Path("outputs/gpu_check.json"))
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu for a dry run")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else dtypes[args.dtype]
    started = time.perf_counter()
    report: dict = {"versions": versions(), "device": str(device), "dtype": str(dtype), "targets": {}}
    print(json.dumps(report["versions"]), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["seconds"] = time.perf_counter() - started
        args.output.write_text(json.dumps(report, indent=1) + "\n")

    save()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for spec in [s.strip() for s in args.targets.split(",") if s.strip()]:
            entry = report["targets"][spec] = {}
            if time.perf_counter() - started > args.budget_seconds:
                entry["skipped"] = "budget spent"
                save()
                continue
            models = load_models(spec, device, dtype, Path(tmp))
            target, tokenizer = models[0], models[1]
            entry["models"] = models[4]
            print(f"\n=== {spec}: {models[4]} ({device}, {dtype})", flush=True)
            prompts = build_prompts(tokenizer, args.prompts, target.config.get_text_config().vocab_size, device)
            eos = eos_token_ids(target, tokenizer) if tokenizer is not None else None
            kwargs = {
                "max_new_tokens": args.max_new_tokens,
                "do_sample": False,
                "temperature": None,
                "top_p": None,
                "top_k": None,
                "eos_token_id": eos or None,
                "pad_token_id": eos[0] if eos else 0,
            }
            sections = {
                "correctness": lambda m, p, k: check_correctness(m, p, k, device),
                "stages_ms_per_round": lambda m, p, k: (measure_stages(m, p, k), 0),
                "tokens_per_second": lambda m, p, k: (measure_throughput(m, p, k, device), 0),
            }
            for name, section in sections.items():
                if time.perf_counter() - started > args.budget_seconds:
                    entry[name] = "skipped: budget spent"
                else:
                    entry[name], failed = section(models, prompts, kwargs)
                    failures += failed
                save()
    print(f"\nwrote {args.output} ({report['seconds']:.0f} s); {'FAILED' if failures else 'all checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
