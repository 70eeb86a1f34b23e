"""The bundled target's tokenizer: byte-level BPE with Qwen-style pre-tokenization, specials and chat template."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "END_OF_TEXT",
    "IM_END",
    "IM_START",
    "MASK",
    "SPECIAL_TOKENS",
    "make_fast_tokenizer",
    "save_tokenizer",
    "train_bpe_tokenizer",
]

END_OF_TEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
# Ids 0..3 in this order; <|MASK|> is the dedicated DFlash mask token (never produced by the chat template).
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, MASK)

# Qwen2/3's pre-tokenizer split: single digits, letters with an optional leading non-letter, whitespace runs.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen renders it (no default system prompt). Extra kwargs such as `enable_thinking` are accepted by
# `apply_chat_template` and simply unused here: the target has no thinking mode.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE `tokenizers.Tokenizer` on ``texts`` with the specials at ids 0..3.

    Byte-level: every byte is in the base alphabet, so any text encodes without an unknown token.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def make_fast_tokenizer(tokenizer: Tokenizer, model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Wrap a trained `Tokenizer` as a `PreTrainedTokenizerFast` with eos ``<|im_end|>`` and the chat template."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | os.PathLike) -> None:
    """Save ``tokenizer`` with the chat template inside ``tokenizer_config.json`` (not a separate ``.jinja``).

    ``tokenizer_class`` is written as ``PreTrainedTokenizerFast``, the name every Transformers version loads
    (Transformers 5 writes its new alias ``TokenizersBackend``, unknown to 4.x).
    """
    tokenizer.save_pretrained(str(directory), save_jinja_files=False)
    config_file = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
