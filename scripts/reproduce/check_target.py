"""Sanity-check an exported target: load it as a user would, generate greedily, and measure its MTP head.

For held-out bench prompts (``outputs/corpus/bench/{code,chat}_question.jsonl``, first turn, chat template with the
generation prompt) the target generates ``--max-new-tokens`` greedily; then one teacher-forced pass over prompt +
continuation gives the MTP head's greedy prediction of every continuation token from ``(x_{t+1}, h_t)``. The
**MTP T1 match rate** is the fraction of continuation tokens the head predicts exactly — what the first DMTP
candidate would get accepted at T=0 — reported per workload, with an example continuation.

Usage::

    nice -n 19 .venv/bin/python scripts/reproduce/check_target.py --model outputs/target/model --prompts 10
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dmtp_hf.modeling.native_mtp import load_native_mtp


@torch.no_grad()
def check(model_dir: Path, bench_dir: Path, prompts: int, max_new_tokens: int) -> dict:
    """Generate on ``prompts`` held-out prompts per workload and measure the MTP T1 match rate."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = load_native_mtp(target)
    report = {"model": str(model_dir)}
    state_file = model_dir / "training_state.json"
    if state_file.exists():
        report["training_state"] = json.loads(state_file.read_text())
    for workload in ("code", "chat"):
        with open(bench_dir / f"{workload}_question.jsonl", encoding="utf-8") as handle:
            questions = [json.loads(line) for line in handle][:prompts]
        matches = total = generated = 0
        start, example = time.perf_counter(), None
        for question in questions:
            messages = [{"role": "user", "content": question["turns"][0]}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            input_ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
            output = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
            continuation = output[0, input_ids.shape[1] :]
            generated += continuation.numel()
            if example is None:
                example = {"prompt": question["turns"][0][:300], "continuation": tokenizer.decode(continuation)}
            # Teacher-forced MTP over the whole sequence: pair (x_{t+1}, h_t) at position t predicts x_{t+2}.
            hidden = target(output, output_hidden_states=True).hidden_states[-1]
            positions = torch.arange(output.shape[1] - 1)[None]
            mtp_tokens = head.logits(head(output[:, 1:], hidden[:, :-1], positions)).argmax(-1)  # predicts x_{t+2}
            first = input_ids.shape[1]  # index of the first generated token
            predicted = mtp_tokens[0, first - 2 : output.shape[1] - 2]
            matches += (predicted == output[0, first:]).sum().item()
            total += predicted.numel()
        report[workload] = {
            "prompts": len(questions),
            "generated_tokens": generated,
            "mtp_t1_match_rate": round(matches / max(total, 1), 4),
            "seconds": round(time.perf_counter() - start, 1),
            "example": example,
        }
    return report


def main() -> None:
    """Parse the arguments, run the check and print (and optionally save) the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("outputs/target/model"))
    parser.add_argument("--bench", type=Path, default=Path("outputs/corpus/bench"))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = check(args.model, args.bench, args.prompts, args.max_new_tokens)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.save is not None:
        args.save.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
