"""Requests the target writes for itself (the "Magpie" method): license-clean instruction prompts.

The chat template is rendered up to the start of a user turn (system prompt included) and the target samples the
user's message until it closes the turn. The result is the kind of request the model was tuned to answer, written
by the model, so it carries no third-party license. Only finished, distinct requests of a sane length are kept.

Output: ``OUT`` JSONL ``{"id": "magpie/<seed>/<n>", "messages": [{"role": "user", "content": ...}]}``; resumable
(batches already written are skipped: each batch draws from its own seed, so a resumed run writes what an
uninterrupted one would).

Usage::

    .venv/bin/python scripts/reproduce/smollm2/magpie.py --target outputs/smollm2/target \\
        --out outputs/smollm2/prompts/train_magpie.jsonl --count 1500
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from dmtp_hf.training.regenerate import completed_ids

MARKER = "\x00MAGPIE\x00"


def user_prefix(tokenizer) -> str:
    """The rendered chat up to where the user's words begin (the template's default system prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    return text[: text.index(MARKER)]


def keep(text: str, finished: bool, seen: set[str]) -> bool:
    """A finished request of 16-600 characters, not seen before, with no template tokens in it."""
    text = text.strip()
    return finished and 16 <= len(text) <= 600 and "<|" not in text and text.lower() not in seen


def main() -> None:
    """Sample ``--count`` distinct requests in batches and append them to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="outputs/smollm2/target")
    parser.add_argument("--out", default="outputs/smollm2/prompts/train_magpie.jsonl")
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    completed_ids(out)  # drops a partial last line left by a killed run
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    seen = {r["messages"][0]["content"].strip().lower() for r in rows}
    batches_done = 1 + max((int(r["id"].split("/")[1]) - args.seed for r in rows), default=-1)

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompt = tokenizer([user_prefix(tokenizer)] * args.batch_size, return_tensors="pt", add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    batch = batches_done
    with open(out, "a", encoding="utf-8") as handle, tqdm(total=args.count, initial=len(rows)) as bar:
        while len(rows) < args.count:
            torch.manual_seed(args.seed + batch)
            with torch.no_grad():
                generated = model.generate(
                    **prompt,
                    do_sample=True,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=eos,
                )[:, prompt["input_ids"].shape[1] :]
            for n, tokens in enumerate(generated):
                finished = bool((tokens == eos).any())
                text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                if len(rows) < args.count and keep(text, finished, seen):
                    seen.add(text.lower())
                    row = {"id": f"magpie/{args.seed + batch}/{n}", "messages": [{"role": "user", "content": text}]}
                    rows.append(row)
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                    bar.update(1)
            handle.flush()
            batch += 1
    print(f"{len(rows)} requests -> {out}")


if __name__ == "__main__":
    main()
