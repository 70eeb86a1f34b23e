"""Where a speculative round's time goes: ``torch.profiler`` over real requests, summarised as a markdown table.

Runs plain ``generate`` and each strategy on the same prompts (bundled target and drafts by default, greedy, batch
size 1) under the profiler. Per strategy it reports the wall time per generated token, each engine stage's share
of the run (the ``dmtp::<stage>`` ranges ``SpecStats`` opens) and the operators that cost the most self time.

    python scripts/profile_round.py                                   # writes reports/performance/profile.md + .json
    python scripts/profile_round.py --prompts 8 --max-new-tokens 128 --strategies dmtp,mtp1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

import dmtp_hf
from dmtp_hf.bundled import default_paths
from dmtp_hf.evaluation.prompts import load_bundled_set

STRATEGIES = {
    "dmtp": ("dmtp", "dmtp", 1),
    "dflash": ("dflash", "dflash", 1),
    "mtp1": ("dmtp", "mtp", 1),
    "mtp4": ("dmtp", "mtp", 4),
}
STAGES = ["prefill", "draft_prefill", "mtp", "t1", "mtp_step", "dflash", "verify", "commit", "rollback"]


def _prompts(tokenizer, count: int) -> list[torch.Tensor]:
    turns = [prompt.turns[0] for prompt in load_bundled_set("humaneval", limit=count).prompts]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for turn in turns
    ]


def _run(target, prompts, max_new_tokens: int, drafter=None, strategy=None, mtp_steps=1):
    """Generate every prompt under the profiler; returns (seconds, new tokens, profiler)."""
    new_tokens = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for input_ids in prompts:
            if drafter is None:
                out = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
            else:
                out = dmtp_hf.generate(
                    target, input_ids, drafter, strategy=strategy, mtp_steps=mtp_steps, max_new_tokens=max_new_tokens
                )
            new_tokens += out.shape[1] - input_ids.shape[1]
        seconds = time.perf_counter() - start
    return seconds, new_tokens, prof


def _summary(name: str, seconds: float, new_tokens: int, prof, top: int) -> dict:
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    ranges = {e.key.removeprefix("dmtp::"): e.cpu_time_total for e in events if e.key.startswith("dmtp::")}
    operators = sorted((e for e in events if not e.key.startswith("dmtp::")), key=lambda e: -e.self_cpu_time_total)
    return {
        "name": name,
        "ms_per_token": 1e3 * seconds / max(new_tokens, 1),
        "new_tokens": new_tokens,
        "stage_share": {stage: ranges[stage] / total_us for stage in STAGES if stage in ranges},
        "top_operators": [
            {"op": e.key, "share": e.self_cpu_time_total / total_us, "calls": e.count} for e in operators[:top]
        ],
    }


def _markdown(results: list[dict], args) -> str:
    lines = [
        "# Where a round's time goes (torch.profiler, CPU)",
        "",
        f"Bundled target, fp32, greedy, batch size 1, {args.prompts} HumanEval prompts, {args.max_new_tokens} new "
        f"tokens, {torch.get_num_threads()} thread(s). Regenerate: `python scripts/profile_round.py`.",
        "",
        "| method | ms / token | " + " | ".join(STAGES) + " |",
        "|---|---|" + "---|" * len(STAGES),
    ]
    for r in results:
        shares = " | ".join(f"{100 * r['stage_share'][s]:.0f} %" if s in r["stage_share"] else "" for s in STAGES)
        lines.append(f"| {r['name']} | {r['ms_per_token']:.2f} | {shares} |")
    lines += ["", "Stage shares are of the profiled CPU time (`dmtp::<stage>` ranges, children included).", ""]
    for r in results:
        ops = ", ".join(f"`{o['op']}` {100 * o['share']:.0f} %" for o in r["top_operators"])
        lines.append(f"- **{r['name']}**, top operators by self time: {ops}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Profile plain generate and each strategy; write markdown and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--strategies", default="dmtp,dflash,mtp1,mtp4")
    parser.add_argument("--top", type=int, default=6, help="operators listed per method")
    parser.add_argument("--output-dir", type=Path, default=Path("reports/performance"))
    args = parser.parse_args(argv)
    paths = default_paths(("target", "dmtp", "dflash"))
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    drafts = {kind: dmtp_hf.DMTPDraftModel.from_pretrained(paths[kind]).bind(target) for kind in ("dmtp", "dflash")}
    prompts = _prompts(tokenizer, args.prompts)
    _run(target, prompts[:1], 8)  # warm-up
    results = [_summary("plain generate", *_run(target, prompts, args.max_new_tokens), args.top)]
    for name in args.strategies.split(","):
        draft, strategy, steps = STRATEGIES[name]
        run = _run(target, prompts, args.max_new_tokens, drafts[draft], strategy, steps)
        results.append(_summary(name, *run, args.top))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "profile.json").write_text(json.dumps(results, indent=2))
    text = _markdown(results, args)
    (args.output_dir / "profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
