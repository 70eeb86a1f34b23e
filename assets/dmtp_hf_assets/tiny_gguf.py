"""A tiny random Llama GGUF file (SmolLM2's layout in miniature) for tests of the GGUF set-up path.

`make_tiny_llama_gguf` writes, with the ``gguf`` package's ``GGUFWriter``, what Transformers' GGUF loader needs to
build both the model and the tokenizer: architecture ``llama`` with its hyper-parameters, float32 tensors under
llama.cpp's names (``token_embd``, ``blk.{i}.attn_q`` ..., ``output_norm``; no ``output.weight``, so the embeddings
are tied as in SmolLM2), and a byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``): the 256 byte symbols,
a few merges, and the ChatML special tokens marked as control tokens, with a ChatML chat template.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["TINY_GGUF_CHAT_TEMPLATE", "TINY_GGUF_SPECIALS", "make_tiny_llama_gguf"]

TINY_GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # bos/pad, -, eos (SmolLM2's choice)
TINY_GGUF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Byte-level spellings (space = "Ġ", newline = "Ċ"): merged into single tokens so that tokenization uses merges.
_MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r", "Ġ i", "Ġi s", "Ċ Ċ")


def _byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE spells bytes with (GPT-2's ``bytes_to_unicode``), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def make_tiny_llama_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
) -> Path:
    """Write a tiny random float32 Llama GGUF with a byte-level BPE tokenizer at ``path``; return the path.

    The vocabulary is the 256 byte symbols, one token per merge in ``_MERGES``, then `TINY_GGUF_SPECIALS`
    (control tokens); ``<|endoftext|>`` is BOS and padding, ``<|im_end|>`` EOS. Weights are seeded normal draws
    (norms around 1), so two calls with the same seed write the same file.
    """
    from gguf import GGUFWriter, TokenType

    symbols = _byte_symbols()
    tokens = symbols + [merge.replace(" ", "") for merge in _MERGES] + list(TINY_GGUF_SPECIALS)
    types = [int(TokenType.NORMAL)] * (len(tokens) - len(TINY_GGUF_SPECIALS))
    types += [int(TokenType.CONTROL)] * len(TINY_GGUF_SPECIALS)
    vocab, head_dim = len(tokens), hidden_size // num_heads
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden_size)).astype(np.float32)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(0)  # ALL_F32
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(_MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_GGUF_CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden_size))
    for i in range(num_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(num_heads * head_dim, hidden_size))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(num_kv_heads * head_dim, hidden_size))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(num_kv_heads * head_dim, hidden_size))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(hidden_size, num_heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(intermediate_size, hidden_size))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(intermediate_size, hidden_size))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(hidden_size, intermediate_size))
    writer.add_tensor("output_norm.weight", norm())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
