"""Who may attend to whom in a DFlash block, and the mask each attention kernel expects.

One visibility rule (:func:`dflash_visibility`) serves inference and training, dense SDPA/eager masks and
FlexAttention's ``mask_mod``; :func:`attention_mask_for_implementation` turns it into what a kernel takes.
"""

from __future__ import annotations

import torch

__all__ = ["attention_mask_for_implementation", "dflash_visibility", "flex_key_length"]

# torch 2.13's CPU FlexAttention kernel (inductor's C++ template) reads past the last key when the key length is
# 8 modulo 16: outputs then depend on uninitialised memory (wrong by up to ~1, or NaN; different on every compile).
# Keys padded to whole 128-key blocks (the BlockMask's own block size) are always computed right, so on CPU the
# BlockMask is built for the padded length, with the padding invisible, and the attention pads K/V to match.
FLEX_CPU_KEY_MULTIPLE = 128


def flex_key_length(key_length: int, device: torch.device | str) -> int:
    """The key length a FlexAttention call is made with: ``key_length`` rounded up to whole blocks on CPU."""
    if torch.device(device).type != "cpu":
        return key_length
    return -(-key_length // FLEX_CPU_KEY_MULTIPLE) * FLEX_CPU_KEY_MULTIPLE


def dflash_visibility(
    query_positions: torch.Tensor,
    query_blocks: torch.Tensor,
    query_context_end: torch.Tensor,
    key_positions: torch.Tensor,
    key_blocks: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Whether each query may attend to each key (broadcasting; ``True`` = visible).

    Keys are either *context* (``key_blocks < 0``: projected target features) or *block* slots (``key_blocks``
    = the block index). A context key is visible iff its position is strictly before the query's block anchor
    (``query_context_end``: the target has not processed the anchor A yet, the classic bug is ``<=``). A block
    key is visible iff it belongs to the query's own block (bidirectional; ``causal`` restricts to
    ``key_pos <= query_pos``). ``window`` (sliding layers) additionally requires ``query_pos - key_pos < window``
    and, for bidirectional layers, ``key_pos - query_pos < window``.

    The same function builds dense SDPA/eager masks and serves as a FlexAttention ``mask_mod`` body.
    """
    is_context = key_blocks < 0
    visible = torch.where(is_context, key_positions < query_context_end, key_blocks == query_blocks)
    if causal:
        visible = visible & (is_context | (key_positions <= query_positions))
    if window is not None:
        visible = visible & (query_positions - key_positions < window)
        if not causal:
            visible = visible & (key_positions - query_positions < window)
    return visible


def attention_mask_for_implementation(
    visible: torch.Tensor | None, attn_implementation: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """Turn a boolean ``[B, 1, Q, K]`` visibility mask into what the selected attention kernel expects."""
    if visible is None:
        return None
    if attn_implementation == "sdpa":
        return visible
    if "flash" in attn_implementation:
        if bool(visible.all()):
            return None
        raise NotImplementedError(
            "flash-attn cannot express DFlash's block/context visibility mask; use attn_implementation='sdpa' "
            "or 'flex_attention' for masked (training or sliding-window) forwards."
        )
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        bsz, _, q_len, kv_len = visible.shape
        padded = flex_key_length(kv_len, visible.device)
        visible = torch.nn.functional.pad(visible, (0, padded - kv_len), value=False)  # padding keys: invisible

        def mask_mod(b, h, q_idx, kv_idx):
            return visible[b, 0, q_idx, kv_idx]

        return create_block_mask(mask_mod, bsz, None, q_len, padded, device=visible.device)
    # eager takes an additive mask
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
