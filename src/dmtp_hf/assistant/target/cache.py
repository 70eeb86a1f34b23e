"""The target's cache across rounds for a batch whose rows commit different numbers of tokens (ragged acceptance).

Attention KV: every verify appends its K + 1 entries for every row; a per-row validity mask ``valid [B, T]``
marks which cache slots are committed history, and the 4D attention mask of the next forward hides the others
(RoPE positions are per row, so slot order does not matter). Trailing slots rejected by *every* row are cropped,
so at batch size 1 the cache is exactly the committed history (as a plain crop would leave it).

Linear-attention (GatedDeltaNet) layers of hybrid targets cannot be masked after the fact: their recurrent state
after the verify has absorbed the rejected tokens. ``rollback="rebuild"`` (default) rebuilds each row's state after
its last kept token from the verify's own layer inputs (``linear_attention.py``); ``rollback="replay"`` (batch size
1) snapshots the states, and after a partial acceptance restores them and re-runs the target on the kept tokens.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticCache,
    StaticLayer,
)

from ...modeling.attention_masks import attention_mask_for_implementation
from .linear_attention import GatedDeltaRollback

ROLLBACKS = ("rebuild", "replay")


def crop_attention(layer, tokens_to_remove: int) -> None:
    """Crop the attention part of a cache layer (hybrid layers hold both attention KV and linear states).

    Static layers only move their write index back (in place, no reallocation). Sliding-window layers are always
    cropped, even by 0: that trims their recorded past back to the window.
    """
    for attention_class in (DynamicSlidingWindowLayer, DynamicLayer, StaticLayer):
        if isinstance(layer, attention_class):
            if tokens_to_remove or attention_class is DynamicSlidingWindowLayer:
                attention_class.crop(layer, -tokens_to_remove)
            return


STATIC_CACHE_BUCKET = 256  # static cache lengths are multiples of this


def new_static_cache(target, max_cache_len: int) -> StaticCache:
    """A ``StaticCache`` of at least ``max_cache_len`` slots, rounded up to a multiple of `STATIC_CACHE_BUCKET` and
    never smaller than the last one made for ``target`` (the attribute Transformers' ``generate`` keeps for the same
    purpose): a compiled verify keeps its graphs across calls instead of recompiling every width for each new prompt
    length (the cache's length is in every graph's guards)."""
    bucketed = -(-max_cache_len // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
    size = max(bucketed, getattr(target, "_previous_max_cache_length", -1))
    target._previous_max_cache_length = size
    return StaticCache(config=target.config, max_cache_len=size)


def static_capacity(cache: Cache) -> int | None:
    """Slots of the smallest fixed-size attention layer (``None`` for caches that grow)."""
    sizes = [layer.max_cache_len for layer in cache.layers if getattr(layer, "max_cache_len", None)]
    return min(sizes) if sizes else None


class TargetCacheState:
    """Bookkeeping of the target cache for ragged speculative decoding (see the module docstring).

    ``valid [B, T]`` marks committed cache slots; :meth:`attention_mask` builds the mask of a forward over ``q``
    new tokens; :meth:`commit` keeps each row's first ``kept[b]`` verified entries and the matching linear states.
    Call :meth:`close` when done (it removes the hooks of the linear-attention rollback).
    """

    def __init__(
        self, target, cache: Cache, valid: torch.Tensor, rollback: str = "rebuild", replay_forward=None
    ) -> None:
        if rollback not in ROLLBACKS:
            raise ValueError(f"Unknown rollback {rollback!r}; expected one of {ROLLBACKS}.")
        if rollback == "replay" and valid.shape[0] != 1:
            raise ValueError("rollback='replay' supports batch size 1 only; use 'rebuild'.")
        self.target = target
        self.cache = cache
        self.rollback = rollback
        self.replay_forward = replay_forward  # (input_ids, positions) -> None: a target forward (replay only)
        self._verified: tuple[torch.Tensor, torch.Tensor] | None = None  # the verify's (ids, positions)
        self._valid = valid.bool()  # [B, capacity]: slots [0, length) mirror the cache; grown by doubling
        self.length = valid.shape[1]
        self.all_valid = bool(self._valid.all())  # host flag: no row has a hidden slot (no mask needed)
        self.static = static_capacity(cache) is not None  # fixed-size KV: slots past the history hold stale entries
        self.linear_layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.attention_layers = [
            layer
            for layer in cache.layers
            if not isinstance(layer, LinearAttentionCacheLayerMixin) or hasattr(layer, "keys")
        ]
        sliding = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
        if sliding and valid.shape[0] > 1:
            raise NotImplementedError("Sliding-window targets support batch size 1 (windows count cache slots).")
        for layer in sliding:  # keep verified-but-rejected tokens until the crop in `commit`
            DynamicSlidingWindowLayer.activate_past_recording(layer)
        self.rebuild: GatedDeltaRollback | None = None
        self._snapshot: list | None = None
        self._recorded_past = [layer.record_past for layer in self.linear_layers]  # restored by `close`
        if self.linear_layers and rollback == "rebuild":
            self.rebuild = GatedDeltaRollback(target, self.linear_layers)
            for layer in self.linear_layers:
                layer.activate_past_recording()  # conv inputs are kept until `commit` picks each row's window
            self.after_prefill()

    @property
    def valid(self) -> torch.Tensor:
        """``[B, T]`` which cache slots are committed history (a view: appends write in place)."""
        return self._valid[:, : self.length]

    def _append(self, slots: torch.Tensor) -> None:
        """Append ``[B, n]`` validity flags in place (amortised O(n): the buffer doubles when full)."""
        end = self.length + slots.shape[1]
        if end > self._valid.shape[1]:
            grown = self._valid.new_zeros(self._valid.shape[0], max(end, 2 * self._valid.shape[1]))
            grown[:, : self.length] = self.valid
            self._valid = grown
        self._valid[:, self.length : end] = slots
        self.length = end

    def close(self) -> None:
        """Remove the rollback's hooks from the target and leave the cache's layers as plain ``generate`` would find
        them (a cache is continued by the next turn: conv states then stop recording their past)."""
        if self.rebuild is not None:
            self.rebuild.close()
        for layer, recorded in zip(self.linear_layers, self._recorded_past, strict=True):
            layer.record_past = recorded

    def attention_mask(self, q_len: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask of a forward over ``q`` new tokens after the cache, or ``None`` when plain causal is right: a 4D
        mask ``[B, 1, q, T + q]`` for a growing cache, a 2D one ``[B, T + q]`` for a static cache (below)."""
        if self.static:
            return self._static_attention_mask(q_len)
        if self.all_valid:
            return None
        batch, cached = self.valid.shape
        device = self.valid.device
        history = self.valid[:, None, :].expand(batch, q_len, cached)
        new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril().expand(batch, q_len, q_len)
        visible = torch.cat([history, new], dim=-1)[:, None]
        return attention_mask_for_implementation(visible, self.target.config._attn_implementation, dtype)

    def _static_attention_mask(self, q_len: int) -> torch.Tensor | None:
        """The 2D mask ``[B, T + q]`` of a forward over a static cache, as plain ``generate`` passes it: Transformers
        pads it to the cache's slots, which hides the slots past the history (zeros, or the K/V of rejected
        candidates a crop left behind) and the prompt's padding.

        Transformers builds that mask itself only for a cache that says it is compileable: for a 1-token query on
        one that is not, it skips the mask and lets the token attend to every slot. A cache whose linear-attention
        layers record their past (the ``rebuild`` rollback) says it is not, so a width-0 verify would read the stale
        slots; and a 4D mask of the history's size does not fit the static keys. ``None`` where Transformers' own
        causal mask is already right (every slot valid, and it does not skip)."""
        skips_mask = q_len == 1 and not self.cache.is_compileable
        if self.all_valid and not skips_mask:
            return None
        new = torch.ones(self.valid.shape[0], q_len, dtype=torch.long, device=self.valid.device)
        return torch.cat([self.valid.long(), new], dim=1)

    def after_prefill(self) -> None:
        """Shrink recorded conv histories to the kernel window (left zero-padded for short prompts)."""
        if self.rebuild is None:
            return
        for layer in self.linear_layers:
            for i, conv in layer.conv_states.items():
                if conv is None:
                    continue
                kernel = layer.conv_kernel_size[i]
                if conv.shape[-1] < kernel:
                    conv = torch.nn.functional.pad(conv, (kernel - conv.shape[-1], 0))
                layer.conv_states[i] = conv[..., -kernel:].contiguous()

    @contextlib.contextmanager
    def verifying(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Context for the verify forward over ``input_ids`` at ``positions``: the rollback captures what it needs
        (or snapshots the states, for replay)."""
        self._verified = (input_ids, positions)
        if self.rebuild is not None:
            self.rebuild.before_verify()
            try:
                yield
            finally:
                self.rebuild.after_verify()
            return
        if self.linear_layers:  # replay: clone the states the verify is about to overwrite
            self._snapshot = [
                (
                    {i: s.clone() for i, s in layer.conv_states.items() if s is not None},
                    {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None},
                )
                for layer in self.linear_layers
            ]
        yield

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of the cache (finished sequences leave the batch)."""
        self.cache.reorder_cache(rows)
        self._valid = self._valid[rows]

    def commit(self, kept: torch.Tensor, kept_host: list[int]) -> None:
        """Keep the first ``kept[b]`` (>= 1) of the tokens the last verify appended for row b.

        ``kept_host`` is the same counts on the host (the loop already has them). With ``rollback="replay"`` a
        partial acceptance restores the states and re-runs the target on the kept tokens (``replay_forward``).
        """
        num_processed = self._verified[0].shape[1]
        if self.rollback == "replay" and self.linear_layers:
            self._commit_replay(kept_host[0], num_processed)
            return
        steps = torch.arange(num_processed, device=self._valid.device)
        self._append(steps[None] < kept[:, None])
        self.all_valid = self.all_valid and min(kept_host) == max(kept_host)
        if self.rebuild is not None:
            self.rebuild.commit(kept, all_kept=min(kept_host) == num_processed)
        # Slots rejected by every row are cropped: the cache then holds exactly the committed history at B = 1.
        trailing = num_processed - max(kept_host)
        for layer in self.attention_layers:
            crop_attention(layer, trailing)  # a no-op at 0 except for sliding windows, which it trims
        self.length -= trailing

    def _commit_replay(self, num_kept: int, num_processed: int) -> None:
        if num_kept < num_processed:
            for layer, (conv, recurrent) in zip(self.linear_layers, self._snapshot):
                for i, state in conv.items():
                    layer.conv_states[i].copy_(state)
                for i, state in recurrent.items():
                    layer.recurrent_states[i].copy_(state)
            for layer in self.attention_layers:
                crop_attention(layer, num_processed)
            input_ids, positions = self._verified
            self.replay_forward(input_ids[:, :num_kept], positions[:, :num_kept])
        self._snapshot = None
        self._append(torch.ones(1, num_kept, dtype=torch.bool, device=self._valid.device))


def refill_in_plain_layout(target, cache: Cache, sequences: torch.Tensor, prompt_mask: torch.Tensor | None) -> None:
    """Leave ``cache`` (in place) as plain ``generate`` leaves it after producing ``sequences`` ``[B, L]``: the
    target's entries for ``sequences[:, :-1]``, slot i holding token i, generated tokens (padding after EOS
    included) visible, the prompt's padding not; linear-attention states after the same tokens.

    A batch's speculative cache is not in that layout (rows commit different numbers of tokens per round, and rows
    that finish leave it), and a continued conversation needs it to be. One target forward over the sequences
    rebuilds it, into a new cache whose layers then replace the old ones, so that the caller's object holds them.
    """
    batch, length = sequences.shape
    mask = torch.ones(batch, length - 1, dtype=torch.long, device=sequences.device)
    if prompt_mask is not None:
        mask[:, : prompt_mask.shape[1]] = prompt_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    fresh = DynamicCache(config=target.config)
    inputs = {"input_ids": sequences[:, :-1], "attention_mask": mask, "position_ids": positions}
    target(**inputs, cache=fresh, use_cache=True, logits_to_keep=1)
    cache.layers[:] = fresh.layers
