"""Rolling the target's cache back to the committed tokens after a verify, for every cache kind.

Attention KV (dynamic, static, sliding-window) is cropped. Linear-attention layers (GatedDeltaNet in Qwen3-Next,
Qwen3.5, Qwen3.6) overwrite their recurrent and conv states with the state after the *last* verified token, which
cannot be cropped; Transformers' own assisted decoding therefore refuses these "stateful" models. Here they are
snapshotted before the verify and, after a partial acceptance, restored and replayed on the accepted tokens
(one extra target forward over ``n + 1`` tokens). When everything is accepted nothing is replayed.
"""

from __future__ import annotations

from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
)


def _crop_attention(layer, tokens_to_remove: int) -> None:
    """Crop the attention part of a cache layer (hybrid layers hold both attention KV and linear states).

    Sliding-window layers are always cropped, even by 0: that trims their recorded past back to the window.
    """
    for attention_class in (DynamicSlidingWindowLayer, DynamicLayer, StaticLayer):
        if isinstance(layer, attention_class):
            if tokens_to_remove or attention_class is DynamicSlidingWindowLayer:
                attention_class.crop(layer, -tokens_to_remove)
            return


class CacheRollback:
    """Snapshot/restore helper bound to one target cache.

    Usage per round::

        rollback.before_verify()
        ... target forward over the K + 1 verify tokens ...
        if rollback.after_verify(num_processed=K + 1, num_kept=n + 1):
            ... target forward over the n + 1 kept tokens (replay) ...
    """

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.linear_layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.attention_layers = [
            layer
            for layer in cache.layers
            if isinstance(layer, (DynamicLayer, StaticLayer)) or not isinstance(layer, LinearAttentionCacheLayerMixin)
        ]
        for layer in cache.layers:
            # Sliding windows must keep the verified-but-rejected tokens until the crop below.
            if isinstance(layer, DynamicSlidingWindowLayer):
                DynamicSlidingWindowLayer.activate_past_recording(layer)
        self._snapshot: list[tuple[dict, dict]] | None = None

    @property
    def is_stateful(self) -> bool:
        """Whether the cache holds recurrent states (rollback then needs snapshot + replay)."""
        return bool(self.linear_layers)

    def trim(self) -> None:
        """Trim recorded sliding-window past back to the window (after prefill and after a replay)."""
        for layer in self.attention_layers:
            _crop_attention(layer, 0)

    def before_verify(self) -> None:
        """Snapshot every linear-attention conv/recurrent state (clones; attention KV needs no snapshot)."""
        if not self.linear_layers:
            return
        self._snapshot = [
            (
                {i: None if s is None else s.clone() for i, s in layer.conv_states.items()},
                {i: None if s is None else s.clone() for i, s in layer.recurrent_states.items()},
            )
            for layer in self.linear_layers
        ]

    def after_verify(self, num_processed: int, num_kept: int) -> bool:
        """Drop the target's state for the ``num_processed - num_kept`` rejected tokens.

        Returns ``True`` when the caller must replay the ``num_kept`` tokens (stateful caches, partial acceptance):
        the linear states are then restored to before the verify and all verified attention KV is removed.
        """
        rejected = num_processed - num_kept
        if rejected == 0 or not self.linear_layers:
            self._snapshot = None
            for layer in self.attention_layers:
                _crop_attention(layer, rejected)
            return False
        assert self._snapshot is not None, "before_verify() was not called"
        for layer, (conv, recurrent) in zip(self.linear_layers, self._snapshot):
            for i, state in conv.items():
                if state is not None:
                    _restore(layer.conv_states, i, state)
            for i, state in recurrent.items():
                if state is not None:
                    _restore(layer.recurrent_states, i, state)
        self._snapshot = None
        for layer in self.attention_layers:
            _crop_attention(layer, num_processed)
        return True


def _restore(states: dict, index: int, snapshot) -> None:
    current = states[index]
    if current is not None and current.shape == snapshot.shape:
        current.copy_(snapshot)  # keep the static address (CUDA graphs)
    else:
        states[index] = snapshot
