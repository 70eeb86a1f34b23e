"""Pretrain the bundled Qwen3.5-architecture target with its native MTP head (joint LM + MTP loss), resumable.

Reads the corpus (``build_corpus.py``) and the tokenizer (``train_tokenizer.py``), tokenizes once into a cache under
the output directory, then runs `target_pretraining.pretrain` (next to this script). Relaunching the same command
resumes from ``<out>/checkpoint`` (``--max-steps`` may be raised to train longer). The latest model, in the real
Qwen3.5 layout (``mtp.*`` tensors inside ``model.safetensors``) with its tokenizer, is always at ``<out>/model``.

Usage::

    nohup nice -n 19 .venv/bin/python scripts/reproduce/pretrain_target.py --out outputs/target \\
        >> outputs/target/train.log 2>&1 &
"""

from __future__ import annotations

import os

# OpenMP threads that wait for a descheduled sibling must sleep, not spin: on a shared machine (another job on the
# second core) spinning made a step ~6x slower (24 s vs 4 s for 4 x 512 tokens). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from target_pretraining import PretrainConfig, pretrain, render_corpus, tokenize_documents  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def load_tokens(corpus: Path, tokenizer, cache: Path, split: str, seed: int) -> torch.Tensor:
    """The token stream of ``split``, from ``cache`` when present (written once, atomically)."""
    file = cache / f"{split}_tokens.pt"
    if file.exists():
        return torch.load(file)
    tokens = tokenize_documents(render_corpus(corpus, tokenizer, split), tokenizer, seed=seed, shuffle=split == "train")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    torch.save(tokens, tmp)
    tmp.replace(file)
    return tokens


def main() -> None:
    """Parse the arguments and train (or resume)."""
    defaults = PretrainConfig(output_dir="outputs/target")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=defaults.output_dir)
    parser.add_argument("--corpus", type=Path, default=Path("outputs/corpus"))
    parser.add_argument("--tokenizer", type=Path, default=Path("outputs/tokenizer"))
    parser.add_argument("--threads", type=int, default=2)
    for field in dataclasses.fields(PretrainConfig):
        if field.name in ("output_dir", "betas", "RESUMABLE_CHANGES"):
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, field.name))
        else:
            kind = type(getattr(defaults, field.name))
            parser.add_argument(flag, type=kind, default=getattr(defaults, field.name))
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    handlers = [logging.FileHandler(out / "train_log.txt"), logging.StreamHandler(sys.stdout)]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers)
    logging.getLogger("transformers").setLevel(logging.ERROR)  # the kernel-fallback notices, once per layer
    torch.set_num_threads(args.threads)

    config = PretrainConfig(
        output_dir=str(out),
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig) if hasattr(args, f.name)},
    )
    logging.info("Config: %s", json.dumps(dataclasses.asdict(config)))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_tokens = load_tokens(args.corpus, tokenizer, out / "data", "train", config.seed)
    eval_tokens = load_tokens(args.corpus, tokenizer, out / "data", "heldout", config.seed)
    logging.info("Tokens: train %d, held-out %d", train_tokens.numel(), eval_tokens.numel())
    metrics = pretrain(config, train_tokens, eval_tokens, tokenizer)
    logging.info("Done: %s", json.dumps(metrics))


if __name__ == "__main__":
    main()
