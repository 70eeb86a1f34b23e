"""Who may attend to whom in a DFlash block, and the mask each attention kernel expects.

One visibility rule (:func:`dflash_visibility`) serves inference and training, dense SDPA/eager masks and
FlexAttention's ``mask_mod``; :func:`attention_mask_for_implementation` turns it into what a kernel takes.
"""

from __future__ import annotations

import torch

__all__ = ["attention_mask_for_implementation", "dflash_visibility"]


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

        def mask_mod(b, h, q_idx, kv_idx):
            return visible[b, 0, q_idx, kv_idx]

        bsz, _, q_len, kv_len = visible.shape
        return create_block_mask(mask_mod, bsz, None, q_len, kv_len, device=visible.device)
    # eager takes an additive mask
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
