"""Who may attend to whom in a draft forward, and the mask each attention kernel expects.

One visibility rule (:func:`dflash_visibility`) and one builder (:func:`draft_attention_masks`) serve every draft
attention call: the DFlash block at inference, the native MTP head's causal advance, and training (dense masks for
SDPA/eager, a FlexAttention ``BlockMask`` whose ``mask_mod`` evaluates the same rule). A call is described by an
:class:`AttentionLayout`: the position and block of every query and every key, and which of them are real.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AttentionLayout",
    "attention_mask_for_implementation",
    "dflash_visibility",
    "draft_attention_masks",
    "flex_key_length",
    "layer_kinds",
    "pad_keys_to_block_mask",
]

# torch 2.13's CPU FlexAttention kernel (inductor's C++ template) reads past the last key when the key length is
# 8 modulo 16: outputs then depend on uninitialised memory (wrong by up to ~1, or NaN; different on every compile).
# Keys padded to whole 128-key blocks (the BlockMask's own block size) are always computed right, so on CPU the
# BlockMask is built for the padded length, with the padding invisible, and the attention pads K/V to match.
FLEX_CPU_KEY_MULTIPLE = 128
FAR = 2**40  # a position after every real one (context_end of "all context visible", unwritten slots)


def flex_key_length(key_length: int, device: torch.device | str) -> int:
    """The key length a FlexAttention call is made with: ``key_length`` rounded up to whole blocks on CPU."""
    if torch.device(device).type != "cpu":
        return key_length
    return -(-key_length // FLEX_CPU_KEY_MULTIPLE) * FLEX_CPU_KEY_MULTIPLE


def pad_keys_to_block_mask(key: torch.Tensor, value: torch.Tensor, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero K/V up to the key length a FlexAttention ``BlockMask`` was built for (``flex_key_length``: CPU
    kernels need whole blocks; the mask hides the padding)."""
    lengths = getattr(mask, "seq_lengths", None)
    if lengths is None or lengths[1] <= key.shape[2]:
        return key, value
    extra = lengths[1] - key.shape[2]
    return torch.nn.functional.pad(key, (0, 0, 0, extra)), torch.nn.functional.pad(value, (0, 0, 0, extra))


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


@dataclass
class AttentionLayout:
    """The queries and keys of one draft attention call (``B`` rows, ``Q`` queries, ``K`` keys).

    ``None`` fields are the common case, and let :func:`draft_attention_masks` return no mask at all where every
    key is visible (the fastest kernels, flash-attn included).
    """

    query_positions: torch.Tensor  # [B, Q]
    key_positions: torch.Tensor  # [B, K]
    key_blocks: torch.Tensor  # [B, K] -1 = context, else the block index
    query_blocks: torch.Tensor | None = None  # [B, Q]; None: one block (index 0) holds every query and block key
    context_end: torch.Tensor | None = None  # [B, Q] context keys visible iff position < it; None: all context
    key_valid: torch.Tensor | None = None  # [B, K] bool; None: every key is real
    query_valid: torch.Tensor | None = None  # [B, Q] bool; None: every query is real

    def visible(self, causal: bool, window: int | None) -> torch.Tensor:
        """``[B, 1, Q, K]`` bool. Invalid queries see every key (no all-masked row, hence no NaN; their outputs
        are discarded)."""
        query_positions = self.query_positions[:, None, :, None]
        zeros = torch.zeros_like(query_positions)
        query_blocks = zeros if self.query_blocks is None else self.query_blocks[:, None, :, None]
        context_end = zeros + FAR if self.context_end is None else self.context_end[:, None, :, None]
        visible = dflash_visibility(
            query_positions,
            query_blocks,
            context_end,
            self.key_positions[:, None, None, :],
            self.key_blocks[:, None, None, :],
            causal=causal,
            window=window,
        )
        if self.key_valid is not None:
            visible = visible & self.key_valid[:, None, None, :]
        if self.query_valid is not None:
            visible = visible | ~self.query_valid[:, None, :, None]
        return visible

    def all_visible(self, causal: bool, window: int | None) -> bool:
        """Known without looking at the tensors: one block, all context visible, every key real, no window."""
        return (
            self.query_blocks is None and self.context_end is None and self.key_valid is None and not causal
        ) and window is None


def layer_kinds(layers) -> dict[str, tuple[bool, int | None]]:
    """``{layer_type: (block_causal, sliding_window)}`` of the attention types in draft decoder ``layers``."""
    kinds: dict[str, tuple[bool, int | None]] = {}
    for layer in layers:
        attn = layer.self_attn
        kinds.setdefault(attn.layer_type, (attn.block_causal, attn.sliding_window))
    return kinds


def draft_attention_masks(
    layout: AttentionLayout,
    kinds: dict[str, tuple[bool, int | None]],
    implementation: str,
    dtype: torch.dtype,
) -> dict[str, object]:
    """The mask of every attention ``kind`` (``{name: (causal, window)}``) for ``layout``, as ``implementation``
    takes it: ``None`` where every key is visible, a FlexAttention ``BlockMask`` (its ``mask_mod`` evaluates the
    rule from the layout's per-query and per-key tensors: no dense tensor), or a dense mask for SDPA/eager."""
    masks: dict[str, object] = {}
    for kind, (causal, window) in kinds.items():
        if layout.all_visible(causal, window):
            masks[kind] = None
        elif implementation == "flex_attention":
            masks[kind] = _flex_block_mask(layout, causal, window)
        else:
            masks[kind] = attention_mask_for_implementation(layout.visible(causal, window), implementation, dtype)
    return masks


def one_block_masks(
    position_ids: torch.Tensor, c_new: int, cached: int, kinds: dict, implementation: str, dtype: torch.dtype
):
    """The default layout of the draft's forward: one block (``position_ids[:, c_new:]``) over every context entry,
    the ``cached`` ones at ``0 .. cached - 1`` and the ``c_new`` new ones at ``position_ids[:, :c_new]``."""
    bsz, device = position_ids.shape[0], position_ids.device
    context_positions = torch.cat([torch.arange(cached, device=device).expand(bsz, -1), position_ids[:, :c_new]], 1)
    block_positions = position_ids[:, c_new:]
    layout = AttentionLayout(
        query_positions=block_positions,
        key_positions=torch.cat([context_positions, block_positions], dim=1),
        key_blocks=torch.cat([torch.full_like(context_positions, -1), torch.zeros_like(block_positions)], dim=1),
    )
    return draft_attention_masks(layout, kinds, implementation, dtype)


def _flex_block_mask(layout: AttentionLayout, causal: bool, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    (bsz, q_len), kv_len = layout.query_positions.shape, layout.key_positions.shape[1]
    device = layout.query_positions.device
    padding = flex_key_length(kv_len, device) - kv_len  # invisible keys (torch's CPU kernel, see above)

    def pad(tensor: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, padding), value=value)

    key_positions, key_blocks = pad(layout.key_positions, FAR), pad(layout.key_blocks, -1)
    key_valid = layout.key_valid if layout.key_valid is not None else torch.ones_like(layout.key_blocks, dtype=bool)
    key_valid = pad(key_valid, False)
    query_blocks = layout.query_blocks if layout.query_blocks is not None else torch.zeros_like(layout.query_positions)
    context_end = layout.context_end if layout.context_end is not None else torch.full_like(query_blocks, FAR)
    query_valid = layout.query_valid

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (
            dflash_visibility(
                layout.query_positions[b, q_idx],
                query_blocks[b, q_idx],
                context_end[b, q_idx],
                key_positions[b, kv_idx],
                key_blocks[b, kv_idx],
                causal=causal,
                window=window,
            )
            & key_valid[b, kv_idx]
        )
        return visible if query_valid is None else visible | ~query_valid[b, q_idx]

    return create_block_mask(mask_mod, bsz, None, q_len, kv_len + padding, device=device)


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
