"""Per-stage cost of one speculative round, and an all-rejected round against one plain decode step.

Runs every drafting strategy on the same target with a drafter forced to be wrong (every round accepts 0
candidates, so every round does the full work: draft, verify 8 tokens, roll back, advance), and times plain
one-token decode steps on the same target in the same run. Prints a table and writes JSON.

    python scripts/bench_round_cost.py                                  # random Qwen3.5-architecture target
    python scripts/bench_round_cost.py --target PATH --draft PATH       # real checkpoints
    python scripts/bench_round_cost.py --hidden 512 --layers 8 --rounds 64 --output round_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from dmtp_hf import DMTPConfig, DMTPDraftModel
from dmtp_hf.assistant import DFlashDrafter, DMTPDrafter, MTPDrafter, Proposal, SpecStats, speculative_decode
from dmtp_hf.assistant.drafters.base import DrafterWrapper

STAGE_ROWS = [
    ("mtp", "MTP advance"),
    ("t1", "T1 head + selection"),
    ("mtp_step", "chained MTP steps (MTP-k)"),
    ("dflash", "fusion + DFlash forward + candidates"),
    ("verify", "target verify (K+1 tokens) + acceptance"),
    ("rollback", "target rollback (crop / restore + replay)"),
]


class AlwaysRejected(DrafterWrapper):
    """Wraps a drafter so that its first candidate is never the target's token: every round accepts 0."""

    def __init__(self, inner, reference: torch.Tensor):
        super().__init__(inner)
        self.reference = reference

    def propose(self, prefix, anchor_positions, select, stats):
        """The inner proposal with its first candidate made wrong."""
        proposal = self.inner.propose(prefix, anchor_positions, select, stats)
        truth = self.reference[:, prefix.shape[1]]
        tokens = proposal.tokens.clone()
        tokens[:, 0] = torch.where(tokens[:, 0] == truth, (truth + 1) % 16, tokens[:, 0])
        return Proposal(tokens, proposal.scores)


def build_random_target(hidden: int, layers: int, vocab: int, directory: Path):
    """A random Qwen3.5-architecture target (GDN + gated attention, MTP head) saved in the real layout."""
    from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target

    overrides = {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"] * (layers // 3)
        + ["full_attention"] * (layers % 3),
        "head_dim": hidden // 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_key_head_dim": hidden // 8,
        "linear_value_head_dim": hidden // 8,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
    }
    path = make_tiny_target("qwen3_5", directory, vocab_size=vocab, text_overrides=overrides)
    return load_tiny_target(path)


def forward_seconds(target, prompt: torch.Tensor, steps: int, width: int = 1) -> float:
    """Mean wall time of one raw cached target forward over ``width`` tokens (``width=1``: the plain decoding step).

    ``width > 1`` is what a verify of ``width - 1`` candidates costs the model itself: no hooks, no feature
    capture, no processors; the cache grows by ``width`` per call as a verify that accepts everything would.
    """
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        out = target(prompt, cache=cache, use_cache=True, logits_to_keep=1)
        tokens = out.logits[:, -1:].argmax(-1).repeat(1, width)
        for _ in range(3):  # warm-up
            out = target(tokens, cache=cache, use_cache=True)
            tokens = out.logits[:, -1:].argmax(-1).repeat(1, width)
        _sync(prompt.device)
        start = time.perf_counter()
        for _ in range(steps):
            out = target(tokens, cache=cache, use_cache=True)
            tokens = out.logits[:, -1:].argmax(-1).repeat(1, width)
        _sync(prompt.device)
        return (time.perf_counter() - start) / steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="target checkpoint with a native MTP head")
    parser.add_argument("--draft", type=Path, help="DMTP draft checkpoint (random if omitted)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions (medians are reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    parser.add_argument("--output", type=Path, default=None, help="JSON output path")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(args.dtype)
    dtype = dtype or getattr(torch, args.dtype)
    profile = device.type == "cuda"  # synchronise around stages so CUDA stage times are exact

    with tempfile.TemporaryDirectory() as tmp:
        if args.target is None:
            target = build_random_target(args.hidden, args.layers, args.vocab, Path(tmp) / "target")
            source = f"random Qwen3.5-architecture target (hidden {args.hidden}, {args.layers} layers)"
        else:
            target = AutoModelForCausalLM.from_pretrained(args.target).eval()
            source = str(args.target)
        target = target.to(device=device, dtype=dtype)
        source += f", {device.type} {str(dtype).removeprefix('torch.')}"
        text = target.config.get_text_config(decoder=True)
        if args.draft is not None:
            draft = DMTPDraftModel.from_pretrained(args.draft).to(device=device, dtype=dtype).bind(target)
        else:
            hidden = text.hidden_size
            draft = DMTPDraftModel(
                DMTPConfig(
                    vocab_size=text.vocab_size,
                    hidden_size=hidden,
                    intermediate_size=3 * hidden,
                    num_hidden_layers=args.draft_layers,
                    num_attention_heads=8,
                    num_key_value_heads=2,
                    head_dim=hidden // 8,
                    num_target_layers=text.num_hidden_layers,
                    mask_token_id=text.vocab_size - 1,
                )
            ).eval()
            draft = draft.to(device=device, dtype=dtype).bind(target)
        # The same backbone run as plain DFlash ([A, MASK x 7]), so the comparison isolates the drafting strategy.
        dflash_config = DMTPConfig.from_dict(draft.config.to_dict())
        dflash_config.anchor_layout = "dflash"
        dflash = DMTPDraftModel(dflash_config).eval().to(device=device, dtype=dtype)
        dflash.load_state_dict({k: v for k, v in draft.state_dict().items() if not k.startswith("fusion.")})
        dflash.bind(target, native_mtp=draft.native_mtp)

        prompt = torch.randint(0, text.vocab_size - 1, (1, args.prompt_length), device=device)
        max_length = args.prompt_length + args.rounds + 1
        reference = target.generate(prompt, do_sample=False, max_length=max_length + 8)
        # name -> (drafter, linear-attention rollback); "dmtp-replay" measures snapshot + replay against per-step.
        strategies = {
            "dmtp": (DMTPDrafter(draft, draft.native_mtp), "rebuild"),
            "dmtp-replay": (DMTPDrafter(draft, draft.native_mtp), "replay"),
            "dflash": (DFlashDrafter(dflash), "rebuild"),
            "mtp1": (MTPDrafter(draft.native_mtp, 1), "rebuild"),
            "mtp4": (MTPDrafter(draft.native_mtp, 4), "rebuild"),
            # fixed device-side slots; CUDA graphs for MTP advance, T1 + fusion and the DFlash block on GPU
            "dmtp-fast": (DMTPDrafter(draft, draft.native_mtp, fixed_shapes=True), "rebuild"),
        }
        # Interleave strategies and plain steps over repetitions and keep medians: machine noise hits all alike.
        samples: dict[str, list[dict]] = {name: [] for name in strategies}
        plain_samples = []
        widths = sorted({drafter.num_candidates + 1 for drafter, _ in strategies.values()})
        raw_samples: dict[int, list[float]] = {width: [] for width in widths}
        for drafter, rollback in strategies.values():  # warm-up
            wrapped = AlwaysRejected(drafter, reference)
            speculative_decode(
                target, prompt, wrapped, max_length=args.prompt_length + 4, rollback=rollback, profile=profile
            )
        for _ in range(args.repeats):
            plain_samples.append(forward_seconds(target, prompt, args.rounds))
            for width in widths:
                raw_samples[width].append(forward_seconds(target, prompt, args.rounds, width))
            for name, (drafter, rollback) in strategies.items():
                stats = SpecStats(drafter.num_candidates, name)
                wrapped = AlwaysRejected(drafter, reference)
                _sync(device)
                start = time.perf_counter()
                speculative_decode(
                    target, prompt, wrapped, max_length=max_length, stats=stats, rollback=rollback, profile=profile
                )
                _sync(device)
                total = time.perf_counter() - start
                rounds = stats.num_rounds
                setup = stats.stage_seconds["prefill"] + stats.stage_seconds["draft_prefill"]
                sample = {key: stats.stage_seconds.get(key, 0.0) / rounds for key, _ in STAGE_ROWS}
                sample["round"] = (total - setup) / rounds
                sample["hist"] = stats.hist
                samples[name].append(sample)
        plain = statistics.median(plain_samples)
        raw = {width: statistics.median(times) for width, times in raw_samples.items()}
        results = {}
        for name, runs in samples.items():
            median = {key: statistics.median(run[key] for run in runs) for key in [*dict(STAGE_ROWS), "round"]}
            width = strategies[name][0].num_candidates + 1
            results[name] = {
                "raw_forward_ms": 1e3 * raw[width],
                "verify_over_raw_forward": median["verify"] / raw[width],
                "drafter_share_of_round": (median["mtp"] + median["t1"] + median["mtp_step"]) / median["round"],
                "rounds": sum(runs[0]["hist"]),
                "stage_ms": {key: 1e3 * median[key] for key, _ in STAGE_ROWS},
                "round_ms": 1e3 * median["round"],
                "round_over_plain_step": median["round"] / plain,
                "hist": runs[0]["hist"],
            }

    names = list(results)
    header = f"{'stage (ms/round)':46s}" + "".join(f"{n:>12s}" for n in names)
    lines = [
        f"Target: {source}; prompt {args.prompt_length} tokens; {args.rounds} all-rejected rounds per run; "
        f"median of {args.repeats} interleaved runs",
        header,
    ]
    for key, label in STAGE_ROWS:
        lines.append(f"{label:46s}" + "".join(f"{results[n]['stage_ms'][key]:12.3f}" for n in names))
    lines.append(f"{'whole round':46s}" + "".join(f"{results[n]['round_ms']:12.3f}" for n in names))
    lines.append(
        f"{'raw target forward, same K+1 tokens':46s}" + "".join(f"{results[n]['raw_forward_ms']:12.3f}" for n in names)
    )
    lines.append(
        f"{'verify / raw forward':46s}" + "".join(f"{results[n]['verify_over_raw_forward']:12.2f}" for n in names)
    )
    lines.append(
        f"{'(MTP advance + T1 + fusion) / round':46s}"
        + "".join(f"{results[n]['drafter_share_of_round']:12.1%}" for n in names)
    )
    lines.append(f"{'plain decode step':46s}" + "".join(f"{1e3 * plain:12.3f}" for _ in names))
    ratio_row = "".join(f"{results[n]['round_over_plain_step']:12.2f}" for n in names)
    lines.append(f"{'all-rejected round / plain step':46s}" + ratio_row)
    print("\n".join(lines))
    if args.output is not None:
        payload = {"target": source, "plain_step_ms": 1e3 * plain, "strategies": results, "table": lines}
        args.output.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
