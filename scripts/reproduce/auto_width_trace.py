"""What `verify_length="auto"` chose on the bundled target, next to fixed K (reports/performance/README.md, "Why the
cells miss"): the widths per round, the plain steps, and each window the guard rail judged (drafted rounds' tokens
per second against plain steps).

    python scripts/reproduce/auto_width_trace.py [--strategy mtp4] [--batch-size 2] [--threads 1]

Held-out prompts: the first four code and four chat questions of the corpus (scripts/reproduce/build_corpus.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dmtp_hf
from dmtp_hf import DMTPDraftModel
from dmtp_hf.bundled import default_paths
from dmtp_policy import guard as width_guard


def trace_guard() -> None:
    """Print each window the guard rail judges (wraps `GuardRail._close`; the library itself prints nothing)."""
    close = width_guard.GuardRail._close

    def traced(self, plain_verify_seconds):
        window = self.drafted.maxlen
        if self.width and not self.backing_off and len(self.drafted) == window - 1:
            tokens = sum(t for t, _ in self.drafted) + self.tokens
            seconds = sum(s for _, s in self.drafted) + self.seconds
            plain = self.plain_rate(self.batch_size, plain_verify_seconds)
            print(f"  guard, B={self.batch_size}: drafted {tokens / seconds:.0f} tok/s, plain {plain:.0f} tok/s")
        return close(self, plain_verify_seconds)

    width_guard.GuardRail._close = traced


def main() -> None:
    """Fixed K and auto, twice each, interleaved; then the widths auto chose."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="mtp4", help="mtpK or dmtp")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--corpus", default="outputs/corpus/bench")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trace_guard()
    paths = default_paths()
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    tokenizer.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    draft = DMTPDraftModel.from_pretrained(paths["dmtp"], target=target).eval()
    prompts = []
    for name in ("code_question", "chat_question"):
        with open(f"{args.corpus}/{name}.jsonl") as f:
            for line in list(f)[:4]:
                request = json.loads(line)["turns"][0]
                messages = [{"role": "user", "content": request}]
                prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    options = {"strategy": "mtp", "mtp_steps": int(args.strategy[3:])} if args.strategy.startswith("mtp") else {}

    def run(verify_length):
        start, widths, plain = time.perf_counter(), Counter(), 0
        for batch in batches:
            encoded = tokenizer(batch, return_tensors="pt", padding=True)
            out = dmtp_hf.generate(
                target,
                encoded.input_ids,
                draft,
                attention_mask=encoded.attention_mask,
                verify_length=verify_length,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                **options,
            )
            widths.update(out.spec_stats.verify_widths)
            plain += out.spec_stats.plain_rounds
        return time.perf_counter() - start, dict(sorted(widths.items())), plain

    for repeat in range(2):  # the first auto call also times the target's verify widths
        for verify_length in (None, "auto"):
            seconds, widths, plain = run(verify_length)
            label = "auto" if verify_length else "fixed K"
            print(f"repeat {repeat}, {label}: {seconds:.2f} s; widths {widths or '-'}; plain steps {plain}", flush=True)


if __name__ == "__main__":
    main()
