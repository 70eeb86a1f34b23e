"""GPU check of the fast path: CUDA-graph replay gives the eager tokens; per-stage round costs; tokens/s.

One command, sized for well under 5 minutes on one H200 (bundled models, 8 prompts x 128 new tokens):

    python scripts/gpu_check.py                              # bundled target + drafts, CUDA, bf16
    python scripts/gpu_check.py --random-target 2048x12      # also fine: a random larger Qwen3.5-architecture target
    python scripts/gpu_check.py --device cpu --prompts 2     # dry run of the same code on CPU (no graphs)

It prints three tables and writes them as JSON (``--output``):

1. **Correctness**: for every prompt and drafter (DMTP, DFlash, MTP-1 on the fast path), the tokens with CUDA graphs
   equal the tokens of the same fast path run eagerly (exit code 1 otherwise), and how many prompts also equal
   plain ``generate`` (exact in fp32; bf16 verify blocks may flip near-ties, which is reported, not hidden).
2. **Round stages** in the blog's format (synchronised stage timers): DFlash forward, MTP advance, T1 selection +
   embedding + fusion, target verify, rollback, whole round; and the MTP + T1 share of a DMTP round.
3. **Throughput**: output tokens/s of plain ``generate``, DFlash, DMTP (dynamic and fast path) and MTP-1, with
   ratios against plain decoding, unsynchronised, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dmtp_hf import DMTPConfig, DMTPDraftModel
from dmtp_hf.assistant import DFlashDrafter, DMTPDrafter, MTPDrafter, SpecStats
from dmtp_hf.assistant.generate import generate
from dmtp_hf.evaluation.models import eos_token_ids, load_target, load_tokenizer
from dmtp_hf.evaluation.prompts import load_bundled_set

STAGES = [
    ("dflash", "DFlash forward (replay)"),
    ("mtp", "MTP advance (replay)"),
    ("t1_fusion", "T1 selection + embedding + fusion"),
    ("verify", "target verify + acceptance"),
    ("rollback", "target rollback"),
]
ROUND_STAGES = [key for key, _ in STAGES]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_models(args, device: torch.device, dtype: torch.dtype, workdir: Path):
    """(target, tokenizer, dmtp draft, dflash draft, description)."""
    from dmtp_hf.bundled import NotBuiltError, default_paths

    if args.random_target:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_round_cost import build_random_target

        hidden, layers = (int(v) for v in args.random_target.lower().split("x"))
        target = build_random_target(hidden, layers, 32768, workdir / "target").to(device=device, dtype=dtype).eval()
        tokenizer = None
        description = f"random Qwen3.5-architecture target hidden {hidden}, {layers} layers, random drafts"
    else:
        target_path = args.target or str(default_paths(("target",))["target"])
        target = load_target(target_path, device, dtype)
        tokenizer = load_tokenizer(target_path)
        description = f"target {target_path}"
    drafts = {}
    for name, layout, path in (("dmtp", "dual", args.draft), ("dflash", "dflash", args.dflash_draft)):
        if path is None and not args.random_target:
            try:
                path = str(default_paths((name,))[name])
            except NotBuiltError:
                path = None
        if path is not None:
            draft = DMTPDraftModel.from_pretrained(path, torch_dtype=dtype)
            description += f", {name} draft {path}"
        else:
            draft = random_draft(target, layout)
            description += f", random {name} draft"
        drafts[name] = draft.to(device=device, dtype=dtype).eval().bind(target)
    return target, tokenizer, drafts["dmtp"], drafts["dflash"], description


def random_draft(target, layout: str) -> DMTPDraftModel:
    """A 2-layer random draft for ``target`` (timings and graph checks do not need trained weights)."""
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
    """One speculative generate; returns (new tokens, stats)."""
    out = generate(target, prompt, drafter, profile=profile, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, prompt.shape[1] :], out.spec_stats


def main(argv: list[str] | None = None) -> int:
    """Run the three checks; exit code 1 if a graph replay changed the tokens."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint (default: the bundled target)")
    parser.add_argument("--draft", help="DMTP draft (default: bundled, else random)")
    parser.add_argument("--dflash-draft", help="DFlash draft (default: bundled, else random)")
    parser.add_argument("--random-target", help="HIDDENxLAYERS: a random Qwen3.5-architecture target instead")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", type=Path, default=Path("outputs/gpu_check.json"))
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu for a dry run")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else dtypes[args.dtype]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        target, tokenizer, dmtp, dflash, description = load_models(args, device, dtype, Path(tmp))
        dmtp.native_mtp.to(device=device, dtype=dtype)  # read the MTP tensors while the checkpoint exists
    vocab = target.config.get_text_config().vocab_size
    prompts = build_prompts(tokenizer, args.prompts, vocab, device)
    eos = eos_token_ids(target, tokenizer) if tokenizer is not None else None
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "temperature": None, "top_p": None}
    kwargs["top_k"] = None
    if eos:
        kwargs.update(eos_token_id=eos, pad_token_id=eos[0])
    else:  # random target: run to the length limit
        kwargs.update(eos_token_id=None, pad_token_id=0)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}")
    print(description)

    def drafters(graphs: bool):
        return {
            "dmtp": DMTPDrafter(dmtp, dmtp.native_mtp, fixed_slots=True, cuda_graphs=graphs),
            "dflash": DFlashDrafter(dflash, fixed_slots=True, cuda_graphs=graphs),
            "mtp1": MTPDrafter(dmtp.native_mtp, 1, fixed_slots=True, cuda_graphs=graphs),
        }

    # ---- 1. Correctness: graph replay == eager fast path (and vs plain generate) ----------------------------------
    report: dict = {"device": str(device), "dtype": str(dtype), "models": description, "correctness": {}}
    failures = 0
    with torch.no_grad():
        references = [target.generate(p, **kwargs)[0, p.shape[1] :] for p in prompts]
        eager, graphed = drafters(False), drafters(True)
        for name in eager:
            same_as_eager = same_as_generate = 0
            for prompt, reference in zip(prompts, references):
                tokens_eager, _ = run(target, prompt, eager[name], kwargs)
                tokens_graph, _ = run(target, prompt, graphed[name], kwargs)
                same_as_eager += torch.equal(tokens_eager, tokens_graph)
                same_as_generate += torch.equal(tokens_graph, reference)
            ok = same_as_eager == len(prompts)
            failures += not ok
            report["correctness"][name] = {
                "graph_equals_eager": same_as_eager,
                "equals_generate": same_as_generate,
                "prompts": len(prompts),
            }
            print(
                f"[{'PASS' if ok else 'FAIL'}] {name}: graph replay == eager on {same_as_eager}/{len(prompts)} "
                f"prompts; == plain generate on {same_as_generate}/{len(prompts)}"
            )

    # ---- 2. Per-stage round costs (synchronised stage timers) ----------------------------------------------------
    fast = "fast, graphs" if device.type == "cuda" else "fast"  # graphs need CUDA
    methods = {
        f"dflash ({fast})": lambda: DFlashDrafter(dflash, fixed_slots=True, cuda_graphs=True),
        "dmtp (dynamic, eager)": lambda: DMTPDrafter(dmtp, dmtp.native_mtp),
        f"dmtp ({fast})": lambda: DMTPDrafter(dmtp, dmtp.native_mtp, fixed_slots=True, cuda_graphs=True),
        f"mtp1 ({fast})": lambda: MTPDrafter(dmtp.native_mtp, 1, fixed_slots=True, cuda_graphs=True),
    }
    stage_rows = {}
    with torch.no_grad():
        for label, make in methods.items():
            drafter = make()
            run(target, prompts[0], drafter, kwargs, profile=True)  # warm-up + graph capture
            stats = SpecStats(drafter.num_candidates, label)
            for prompt in prompts:
                _, one = run(target, prompt, drafter, kwargs, profile=True)
                stats.merge(one)
            rounds = max(stats.num_rounds, 1)
            per_round = {key: 1000 * stats.stage_seconds.get(key, 0.0) / rounds for key in ROUND_STAGES}
            per_round["round"] = sum(per_round.values())
            per_round["mtp_t1_share"] = (per_round["mtp"] + per_round["t1_fusion"]) / per_round["round"]
            per_round["acceptance_length"] = stats.acceptance_length_per_verify
            stage_rows[label] = per_round
    report["stages_ms_per_round"] = stage_rows
    header = f"{'stage (ms/round)':38s}" + "".join(f"{label:>24s}" for label in stage_rows)
    print("\n" + header)
    for key, title in [*STAGES, ("round", "whole round"), ("mtp_t1_share", "MTP + T1 share of the round")]:
        cells = []
        for row in stage_rows.values():
            cells.append(f"{100 * row[key]:23.1f}%" if key == "mtp_t1_share" else f"{row[key]:24.3f}")
        print(f"{title:38s}" + "".join(cells))
    print(
        f"{'acceptance length per verify':38s}"
        + "".join(f"{r['acceptance_length']:24.3f}" for r in stage_rows.values())
    )

    # ---- 3. Throughput (no synchronisation inside rounds) --------------------------------------------------------
    throughput = {}
    with torch.no_grad():
        contenders = {"generate": None, **{label: make for label, make in methods.items()}}
        for label, make in contenders.items():
            drafter = make() if make else None
            warm = prompts[0]
            if drafter is None:
                target.generate(warm, **kwargs)
            else:
                run(target, warm, drafter, kwargs)
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
    report["tokens_per_second"] = throughput
    print(f"\n{'method':26s}{'tokens/s':>12s}{'vs generate':>14s}")
    for label, value in throughput.items():
        print(f"{label:26s}{value:12.1f}{value / base:13.2f}x")
    report["seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.output} ({report['seconds']:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
