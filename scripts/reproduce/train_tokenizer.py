"""Train the bundled target's tokenizer: byte-level BPE (~8k) on the training split of the corpus.

Trains on the raw stdlib files and on the chats rendered with the ChatML template (so ``<|im_start|>user`` lines
and code fences get their own merges), then saves a ``PreTrainedTokenizerFast`` (``tokenizer.json`` +
``tokenizer_config.json`` holding the chat template; eos ``<|im_end|>``, pad ``<|endoftext|>``, mask ``<|MASK|>``).

Usage::

    nice -n 19 .venv/bin/python scripts/reproduce/train_tokenizer.py --corpus outputs/corpus --out outputs/tokenizer
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bundled_tokenizer import CHAT_TEMPLATE, make_fast_tokenizer, save_tokenizer, train_bpe_tokenizer
from target_pretraining import render_corpus
from transformers import AutoTokenizer


class _TemplateOnly:
    """The minimal tokenizer interface `render_corpus` needs before the real tokenizer exists."""

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False) -> str:
        """Render ChatML exactly as `CHAT_TEMPLATE` does (checked against it after training)."""
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def corpus_token_counts(corpus: Path, tokenizer) -> dict[str, dict[str, int]]:
    """Documents and tokens (``<|endoftext|>`` separators included) of every corpus JSONL file."""
    counts = {}
    for file in sorted(corpus.glob("*.jsonl")):
        with open(file, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        texts = [row["text"] if "text" in row else _TemplateOnly().apply_chat_template(row["messages"]) for row in rows]
        encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        counts[file.stem] = {"documents": len(rows), "tokens": sum(len(e.ids) for e in encodings) + len(rows)}
    return counts


def main() -> None:
    """Train, save, reload and sanity-check the tokenizer."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("outputs/corpus"))
    parser.add_argument("--out", type=Path, default=Path("outputs/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    start = time.perf_counter()
    documents = render_corpus(args.corpus, _TemplateOnly(), "train")
    tokenizer = make_fast_tokenizer(train_bpe_tokenizer(documents, vocab_size=args.vocab_size))
    save_tokenizer(tokenizer, args.out)

    loaded = AutoTokenizer.from_pretrained(args.out)
    assert loaded.chat_template == CHAT_TEMPLATE
    sample = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    assert loaded.apply_chat_template(sample, tokenize=False) == _TemplateOnly().apply_chat_template(sample)
    characters = sum(map(len, documents[:2000]))
    tokens = sum(len(ids) for ids in loaded(documents[:2000], add_special_tokens=False)["input_ids"])
    stats = {
        "vocab_size": len(loaded),
        "special_tokens": {
            t: loaded.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
        },
        "chars_per_token_sample": round(characters / tokens, 3),
        "seconds": round(time.perf_counter() - start, 1),
        "corpus_tokens": corpus_token_counts(args.corpus, loaded),
    }
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
