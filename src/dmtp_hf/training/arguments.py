"""The argument parsers of ``dmtp train``, ``dmtp regenerate`` and ``dmtp extract``, apart from what they run.

They import nothing but ``argparse``: ``dmtp train --help`` answers at once instead of loading torch, Accelerate and
the trainer first, and a wrong argument is refused before any of that loads. The commands themselves
(`trainer.main`, `regenerate.main`, `features.main`) parse with these same parsers.
"""

from __future__ import annotations

import argparse

__all__ = ["extract_parser", "regenerate_parser", "train_parser"]


def train_parser() -> argparse.ArgumentParser:
    """``dmtp train`` / ``scripts/finetune.py``."""
    parser = argparse.ArgumentParser(
        prog="dmtp train",
        description=(
            "Train a DMTP, DFlash or DFlash2 draft, an MTP head (native or retrofitted), or both jointly, "
            "from a YAML config."
        ),
    )
    parser.add_argument("--config", required=True, help="YAML training config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument(
        "--snapshot",
        metavar="DIR",
        help=(
            "do not train: copy the run's newest checkpoint to DIR/step-N, weights in bfloat16 and no optimizer "
            "state (small enough to commit; the run resumes from it, see docs/scaling.md)"
        ),
    )
    return parser


def regenerate_parser() -> argparse.ArgumentParser:
    """``dmtp regenerate``."""
    parser = argparse.ArgumentParser(
        prog="dmtp regenerate", description="Regenerate the assistant turns of a chat dataset with the target itself."
    )
    parser.add_argument("--target", help="target checkpoint (local generation)")
    parser.add_argument("--endpoint", help="an OpenAI-compatible server URL instead (vLLM, SGLang, TGI)")
    parser.add_argument("--model", default="default", help="--endpoint: the served model name")
    parser.add_argument("--concurrency", type=int, default=8, help="--endpoint: records in flight")
    parser.add_argument("--top-p", type=float, default=None, help="--endpoint: nucleus sampling")
    parser.add_argument("--input", required=True, help="chat JSONL (OpenAI messages or ShareGPT conversations)")
    parser.add_argument("--output", required=True, help="output JSONL (appended to; completed ids are skipped)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--enable-thinking", choices=["true", "false", "unset"], default="unset")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many records in total")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: the checkpoint's dtype on GPU, float32 on CPU (bf16 is slow there)",
    )
    return parser


def extract_parser() -> argparse.ArgumentParser:
    """``dmtp extract``."""
    parser = argparse.ArgumentParser(
        prog="dmtp extract", description="Extract frozen target + MTP features for offline draft training."
    )
    parser.add_argument("--target", required=True, help="target checkpoint (`bundled`: the bundled target)")
    parser.add_argument("--data", required=True, help="chat or pre-tokenized JSONL")
    parser.add_argument("--output", required=True, help="output feature directory")
    parser.add_argument("--target-layer-ids", required=True, help="comma-separated 0-based target layers")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--enable-thinking", choices=["true", "false", "unset"], default="unset")
    parser.add_argument("--no-mtp", action="store_true", help="skip the MTP features (DFlash baseline)")
    parser.add_argument(
        "--head-inputs", action="store_true", help="also store the hidden the MTP head reads (to train the head)"
    )
    parser.add_argument(
        "--target-labels",
        action="store_true",
        help="also store the target's greedy next token at every position (self-distillation on any text)",
    )
    parser.add_argument("--hidden-input", choices=["post_norm", "pre_norm"], default="post_norm")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", help="storage dtype of float features (or 'keep')")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--device-map", default=None, help="e.g. auto: spread a big target over this process's GPUs (Accelerate)"
    )
    return parser
