"""The target's cache across rounds for a batch whose rows commit different numbers of tokens (ragged acceptance).

Attention KV: every verify appends its K + 1 entries for every row; a per-row validity mask ``valid [B, T]``
marks which cache slots are committed history, and the 4D attention mask of the next forward hides the others
(RoPE positions are per row, so slot order does not matter). Trailing slots rejected by *every* row are cropped,
so at batch size 1 the cache is exactly the committed history (as a plain crop would leave it).

Linear-attention (GatedDeltaNet) layers of hybrid targets cannot be masked after the fact: their recurrent state
after the verify has absorbed the rejected tokens. During the verify forward the gated delta rule is therefore run
token by token and the state after *every* step is kept; each row then keeps the state after its own last
accepted token (no replay forward). Conv states keep their full recent history (``record_past``) so that the window
ending at each row's last accepted token can be selected the same way.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
)

from ..modeling.modeling_dmtp import attention_mask_for_implementation


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


class GatedDeltaStepRecorder:
    """Records the recurrent state after every token of multi-token gated-delta-rule calls (the verify forward).

    Transformers' GatedDeltaNet layers call a module-level ``torch_chunk_gated_delta_rule`` for multi-token inputs;
    inside :meth:`recording` it is replaced by the token-by-token recurrent rule of the same module (the kernel the
    plain decoding step uses), which also returns the per-step states. Layers are recorded in call order.
    """

    def __init__(self, target) -> None:
        names = {type(m).__module__ for m in target.modules() if type(m).__name__.endswith("GatedDeltaNet")}
        self.modules = [
            sys.modules[n] for n in sorted(names) if hasattr(sys.modules[n], "torch_chunk_gated_delta_rule")
        ]
        self.states: list[torch.Tensor] = []  # per layer: [B, T, H, Dk, Dv]

    @contextlib.contextmanager
    def recording(self):
        """Within the block, multi-token gated-delta-rule calls record every step's state into :attr:`states`."""
        self.states = []
        originals = {module: module.torch_chunk_gated_delta_rule for module in self.modules}

        def make_stepwise(module):
            recurrent = module.torch_recurrent_gated_delta_rule

            def stepwise(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
                kwargs.pop("cu_seqlens", None)
                outputs, per_step, state = [], [], initial_state
                for i in range(query.shape[1]):  # K + 1 verify positions (not batch or vocabulary)
                    out, state = recurrent(
                        query[:, i : i + 1],
                        key[:, i : i + 1],
                        value[:, i : i + 1],
                        g=g[:, i : i + 1],
                        beta=beta[:, i : i + 1],
                        initial_state=state,
                        output_final_state=True,
                        **kwargs,
                    )
                    outputs.append(out)
                    per_step.append(state)
                self.states.append(torch.stack(per_step, dim=1))
                return torch.cat(outputs, dim=1), state

            return stepwise

        try:
            for module in self.modules:
                module.torch_chunk_gated_delta_rule = make_stepwise(module)
            yield self
        finally:
            for module, original in originals.items():
                module.torch_chunk_gated_delta_rule = original


ROLLBACKS = ("per_step", "replay")


def static_capacity(cache: Cache) -> int | None:
    """Slots of the smallest fixed-size attention layer (``None`` for caches that grow)."""
    sizes = [layer.max_cache_len for layer in cache.layers if getattr(layer, "max_cache_len", None)]
    return min(sizes) if sizes else None


class TargetCacheState:
    """Bookkeeping of the target cache for ragged speculative decoding (see the module docstring).

    ``valid [B, T]`` marks committed cache slots; :meth:`attention_mask` builds the 4D mask of a forward over ``q``
    new tokens; :meth:`commit` keeps each row's first ``kept[b]`` verified entries and the matching linear states.

    ``rollback="replay"`` (batch size 1 only) is the simpler alternative for linear-attention layers: snapshot the
    states before the verify, and after a partial acceptance restore them, drop the verified KV and re-run the
    target on the kept tokens (``replay(kept)``, one extra forward). It is kept to measure against ``per_step``.
    """

    def __init__(self, target, cache: Cache, valid: torch.Tensor, rollback: str = "per_step") -> None:
        if rollback not in ROLLBACKS:
            raise ValueError(f"Unknown rollback {rollback!r}; expected one of {ROLLBACKS}.")
        if rollback == "replay" and valid.shape[0] != 1:
            raise ValueError("rollback='replay' supports batch size 1 only; use 'per_step'.")
        self.target = target
        self.cache = cache
        self.rollback = rollback
        self.valid = valid.bool()  # [B, T]
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
        self.recorder = None
        self._snapshot: list | None = None
        if self.linear_layers and rollback == "per_step":
            self.recorder = GatedDeltaStepRecorder(target)
            if not self.recorder.modules:
                raise NotImplementedError(
                    f"{type(target).__name__} has linear-attention layers whose kernel cannot be recorded per step; "
                    "use rollback='replay'."
                )
            for layer in self.linear_layers:
                layer.activate_past_recording()  # conv states keep their history until `commit` picks the window
            self.after_prefill()

    @property
    def is_stateful(self) -> bool:
        """Whether the target has recurrent (linear-attention) layers."""
        return bool(self.linear_layers)

    def attention_mask(self, q_len: int, dtype: torch.dtype) -> torch.Tensor | None:
        """4D mask ``[B, 1, q, T + q]`` for ``q`` new tokens after the cache, or ``None`` when plain causal is right."""
        if bool(self.valid.all()):
            return None
        batch, cached = self.valid.shape
        device = self.valid.device
        history = self.valid[:, None, :].expand(batch, q_len, cached)
        new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril().expand(batch, q_len, q_len)
        visible = torch.cat([history, new], dim=-1)[:, None]
        return attention_mask_for_implementation(visible, self.target.config._attn_implementation, dtype)

    def after_prefill(self) -> None:
        """Shrink recorded conv histories to the kernel window (left zero-padded for short prompts)."""
        if self.recorder is None:
            return
        for layer in self.linear_layers:
            for i, conv in layer.conv_states.items():
                if conv is None:
                    continue
                kernel = layer.conv_kernel_size[i]
                if conv.shape[-1] < kernel:
                    conv = torch.nn.functional.pad(conv, (kernel - conv.shape[-1], 0))
                layer.conv_states[i] = conv[..., -kernel:].contiguous()

    def verifying(self):
        """Context for the verify forward: per-step linear states are recorded (or snapshotted for replay)."""
        if self.recorder is not None:
            return self.recorder.recording()
        if self.linear_layers:  # replay: clone the states the verify is about to overwrite
            self._snapshot = [
                (
                    {i: s.clone() for i, s in layer.conv_states.items() if s is not None},
                    {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None},
                )
                for layer in self.linear_layers
            ]
        return contextlib.nullcontext()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of the cache (finished sequences leave the batch)."""
        self.cache.reorder_cache(rows)
        self.valid = self.valid[rows]

    def commit(self, kept: torch.Tensor, num_processed: int, replay=None) -> None:
        """Keep the first ``kept[b]`` (>= 1) of the ``num_processed`` tokens the last forward appended for row b.

        With ``rollback="replay"`` a partial acceptance calls ``replay(num_kept)``, which must re-run the target on
        the kept tokens after the states were restored.
        """
        if self.rollback == "replay" and self.linear_layers:
            num_kept = int(kept[0])
            if num_kept < num_processed:
                for layer, (conv, recurrent) in zip(self.linear_layers, self._snapshot):
                    for i, state in conv.items():
                        layer.conv_states[i].copy_(state)
                    for i, state in recurrent.items():
                        layer.recurrent_states[i].copy_(state)
                for layer in self.attention_layers:
                    crop_attention(layer, num_processed)
                replay(num_kept)
            self._snapshot = None
            kept_slots = torch.ones(1, num_kept, dtype=torch.bool, device=self.valid.device)
            self.valid = torch.cat([self.valid, kept_slots], dim=1)
            return
        device = self.valid.device
        steps = torch.arange(num_processed, device=device)
        self.valid = torch.cat([self.valid, steps[None] < kept[:, None]], dim=1)
        if self.linear_layers:
            self._commit_linear(kept)
        # Slots rejected by every row are cropped: the cache then holds exactly the committed history at B = 1.
        trailing = int(num_processed - kept.max())
        for layer in self.attention_layers:
            crop_attention(layer, trailing)  # a no-op at 0 except for sliding windows, which it trims
        if trailing > 0:
            self.valid = self.valid[:, :-trailing]

    def _commit_linear(self, kept: torch.Tensor) -> None:
        last = kept - 1  # [B] index of each row's last kept step
        states = self.recorder.states
        if len(states) != len(self.linear_layers):
            raise RuntimeError(f"recorded {len(states)} linear layers, the cache has {len(self.linear_layers)}")
        for layer, per_step in zip(self.linear_layers, states):
            # per_step [B, T, H, Dk, Dv] -> the state after each row's last kept token
            index = last.view(-1, 1, *([1] * (per_step.dim() - 2))).expand(-1, 1, *per_step.shape[2:])
            chosen = per_step.gather(1, index)[:, 0].to(layer.recurrent_states[0].dtype)
            layer.recurrent_states[0].copy_(chosen)
            for i, conv in layer.conv_states.items():
                if conv is None:
                    continue
                # conv [B, C, kernel + T]: window of `kernel` columns ending at the last kept token
                kernel = layer.conv_kernel_size[i]
                columns = kept[:, None] + torch.arange(kernel, device=conv.device)  # [B, kernel]
                window = conv.gather(2, columns[:, None, :].expand(-1, conv.shape[1], -1))
                layer.conv_states[i] = window.contiguous()
        self.recorder.states = []
