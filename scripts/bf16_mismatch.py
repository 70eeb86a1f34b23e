"""How often bfloat16 speculative decoding differs from plain bfloat16 ``generate`` (both greedy), and where.

In float32 the engine's output is token for token plain ``generate``'s. In bfloat16 the verify (K + 1 tokens in one
forward) and a decoding step (one token) sum in different orders, so near-ties can flip a token and the two outputs
diverge from there (each still a valid greedy decoding of the bf16 model, up to rounding). This measures it:

    python scripts/bf16_mismatch.py                       # bundled target + DMTP draft, CPU bf16, 40 prompts
    python scripts/bf16_mismatch.py --device cuda --limit 80

Prints and writes (``--output``) the share of prompts whose outputs differ, the share of generated tokens up to the
first divergence that matched, and the mean position of the first divergence.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dmtp_hf
from dmtp_hf.bundled import default_paths
from dmtp_hf.evaluation.prompts import load_bundled_set


def main(argv: list[str] | None = None) -> int:
    """Compare plain and speculative greedy decoding in bf16 over bundled prompts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=40, help="prompts in all (MT-Bench and HumanEval first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--strategy", default="dmtp", choices=["dmtp", "dflash", "mtp"])
    parser.add_argument("--output", type=Path, default=Path("outputs/bf16_mismatch.json"))
    args = parser.parse_args(argv)
    paths = default_paths(("target", "dmtp", "dflash"))
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.bfloat16).to(args.device).eval()
    draft_path = paths["dflash"] if args.strategy == "dflash" else paths["dmtp"]
    draft = dmtp_hf.DMTPDraftModel.from_pretrained(draft_path, target=target).eval()
    prompts = []
    for name in ("mt_bench", "humaneval"):
        for prompt in load_bundled_set(name, limit=(args.limit + 1) // 2).prompts:
            messages = [{"role": "user", "content": prompt.turns[0]}]
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            prompts.append(ids.to(args.device))
    differ, matched, compared, first = 0, 0, 0, []
    with torch.no_grad():
        for ids in prompts[: args.limit]:
            plain = target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)[0, ids.shape[1] :]
            ours = dmtp_hf.generate(
                target,
                ids,
                draft,
                strategy=None if args.strategy != "mtp" else "mtp",
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
            )[0, ids.shape[1] :]
            length = min(plain.shape[0], ours.shape[0])
            same = (plain[:length] == ours[:length]).long()
            diverge = int(same.cumprod(0).sum())  # tokens before the first difference
            if diverge < length or plain.shape[0] != ours.shape[0]:
                differ += 1
                first.append(diverge)
            matched += diverge
            compared += max(plain.shape[0], ours.shape[0])
    result = {
        "prompts": len(prompts[: args.limit]),
        "strategy": args.strategy,
        "device": args.device,
        "max_new_tokens": args.max_new_tokens,
        "prompts_differing": differ,
        "share_prompts_differing": differ / max(1, len(prompts[: args.limit])),
        "share_tokens_before_first_divergence": matched / max(1, compared),
        "mean_first_divergence": sum(first) / len(first) if first else None,
    }
    print(json.dumps(result, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
