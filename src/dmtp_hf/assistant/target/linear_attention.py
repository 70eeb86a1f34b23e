"""Per-row rollback of GatedDeltaNet (linear-attention) layers after a verify, from the target's own layers.

A verify runs ``[A, T1..TK]`` through every layer; a GatedDeltaNet layer's recurrent state then has absorbed all
``K + 1`` tokens, while row b keeps only its first ``kept[b]``. Attention KV can be masked after the fact; a
recurrent state cannot. Nothing in Transformers is patched: the verify runs the layer exactly as Transformers does
(its own chunked kernel), and afterwards each row's state is *rebuilt* from what the layer itself produced:

- the conv inputs ``[B, C, kernel + T]`` (``mixed_qkv`` before the causal conv), which the cache keeps while it
  records the past (``activate_past_recording``, a Transformers cache API);
- the gate projections ``b``, ``a`` ``[B, T, heads]``, captured by forward hooks on the layer's own projection
  modules (``in_proj_b``/``in_proj_a``, or ``in_proj_ba`` for Qwen3-Next), only while a verify runs;
- the state before the verify, cloned.

From these, ``q, k, v = split(silu(conv(inputs)))``, ``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt)``,
and one call of the layer module's own gated-delta-rule kernel (recurrent for short verifies) over the ``T`` verify
tokens with ``g = beta = 0`` past each row's kept count gives each row's state after its last kept token: with
``beta = 0`` a step writes nothing, with ``g = 0`` it decays nothing. The conv state is the window of ``kernel``
inputs ending at that token.

Memory: one cloned state per layer (``B x heads x Dk x Dv``), never one per verify step.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ...modeling.native_mtp.hidden import on_thread

# Up to this many verify tokens the state is rebuilt with the recurrent kernel, beyond with the chunked one (measured
# crossover on CPU: 16 tokens, where both cost the same).
RECURRENT_MAX_STEPS = 16


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Transformers GatedDeltaNet layer (Qwen3-Next, Qwen3.5, Qwen3.5-MoE)."""
    return type(module).__name__.endswith("GatedDeltaNet")


def has_gated_delta_net(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` is a GatedDeltaNet."""
    return any(is_gated_delta_net(module) for module in model.modules())


def verify_kernel_kwargs(has_linear_attention: bool, width: int) -> dict:
    """What a ``width``-token target forward passes to GatedDeltaNet layers: their chunked kernel pads every call to
    64-token chunks, so shorter multi-token calls ask for chunks of their own length (the kernel's ``chunk_size``,
    which reaches it through the model's kwargs): the same computation, 1.5-2x cheaper at 2-8 tokens on CPU."""
    return {"chunk_size": width} if has_linear_attention and 1 < width < 64 else {}


class _GateCapture:
    """Forward hooks on one layer's gate projections; keeps ``b`` and ``a`` ``[B, T, heads]`` of the last call."""

    def __init__(self, layer: torch.nn.Module, recorder: GatedDeltaRollback) -> None:
        self.layer = layer
        self.recorder = recorder
        self.b: torch.Tensor | None = None
        self.a: torch.Tensor | None = None
        if hasattr(layer, "in_proj_b") and hasattr(layer, "in_proj_a"):
            self.handles = [
                layer.in_proj_b.register_forward_hook(lambda m, i, out: self._keep(b=out)),
                layer.in_proj_a.register_forward_hook(lambda m, i, out: self._keep(a=out)),
            ]
        elif hasattr(layer, "in_proj_ba"):
            self.handles = [layer.in_proj_ba.register_forward_hook(lambda m, i, out: self._keep(ba=out))]
        else:
            raise NotImplementedError(
                f"{type(layer).__name__} has no in_proj_b/in_proj_a or in_proj_ba gate projections; per-row rollback "
                "cannot rebuild its states: use rollback='replay' (batch size 1)."
            )

    def _keep(self, b=None, a=None, ba=None) -> None:
        # Hooks see every forward of the layer: only this call's verify, in this call's thread, is captured.
        if not self.recorder.capturing or not on_thread(self.recorder.thread):
            return
        if ba is not None:  # Qwen3-Next: [B, T, k_heads, 2 * v_per_k] grouped as (b, a) per key head
            layer = self.layer
            per_k = layer.num_v_heads // layer.num_k_heads
            grouped = ba.view(*ba.shape[:-1], layer.num_k_heads, 2 * per_k)
            b, a = (t.reshape(*ba.shape[:-1], layer.num_v_heads) for t in grouped.split([per_k, per_k], dim=-1))
        if b is not None:
            self.b = b
        if a is not None:
            self.a = a

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class GatedDeltaRollback:
    """Rebuilds each row's GatedDeltaNet states after a verify (see the module docstring).

    Args:
        target: the target model; its GatedDeltaNet layers are found by class name, in ``layer_idx`` order.
        cache_layers: the cache's linear-attention layers, ``cache_layers[i]`` holding ``layers[i]``'s states.
    """

    def __init__(self, target: torch.nn.Module, cache_layers: list) -> None:
        self.layers = sorted((m for m in target.modules() if is_gated_delta_net(m)), key=lambda m: m.layer_idx)
        if len(self.layers) != len(cache_layers):
            raise RuntimeError(f"found {len(self.layers)} GatedDeltaNet layers, the cache has {len(cache_layers)}")
        self.cache_layers = cache_layers
        self.capturing = False
        self.thread = threading.get_ident()  # the generate call's thread (another may run on the same target)
        self.captures = [_GateCapture(layer, self) for layer in self.layers]
        self.initial_states: list[torch.Tensor] = []

    def close(self) -> None:
        """Remove the hooks."""
        for capture in self.captures:
            capture.remove()

    def before_verify(self) -> None:
        """Clone the states the verify is about to overwrite and capture the gates of its forward."""
        self.initial_states = [layer.recurrent_states[0].clone() for layer in self.cache_layers]
        self.capturing = True

    def after_verify(self) -> None:
        """Stop capturing (the verify forward is done)."""
        self.capturing = False

    def commit(self, kept: torch.Tensor, all_kept: bool) -> None:
        """Keep each row's state after its first ``kept[b]`` (>= 1) verify tokens.

        ``all_kept``: every row kept every token (the caller knows it from the host copy of the counts), so the
        recurrent states are already right and only the conv windows are trimmed.
        """
        for layer, cache_layer, capture, initial in zip(
            self.layers, self.cache_layers, self.captures, self.initial_states, strict=True
        ):
            conv_inputs = cache_layer.conv_states[0]  # [B, C, kernel + T]
            kernel = cache_layer.conv_kernel_size[0]
            if not all_kept:
                state = self._rebuild(layer, conv_inputs, capture, initial, kept)
                cache_layer.recurrent_states[0].copy_(state.to(cache_layer.recurrent_states[0].dtype))
            # the conv window of `kernel` inputs ending at each row's last kept token
            columns = kept[:, None] + torch.arange(kernel, device=conv_inputs.device)  # [B, kernel]
            window = conv_inputs.gather(2, columns[:, None, :].expand(-1, conv_inputs.shape[1], -1))
            cache_layer.conv_states[0] = window.contiguous()
        self.initial_states = []

    @staticmethod
    def _rebuild(layer, conv_inputs, capture: _GateCapture, initial, kept) -> torch.Tensor:
        """The state after each row's ``kept`` tokens, from the layer's own weights, inputs and kernel."""
        steps = capture.b.shape[1]
        weight = layer.conv1d.weight  # [C, 1, kernel]
        mixed = F.conv1d(conv_inputs[..., 1:].to(weight.dtype), weight, layer.conv1d.bias, groups=weight.shape[0])
        mixed = ACT2FN[layer.activation](mixed).to(conv_inputs.dtype).transpose(1, 2)  # [B, T, C]
        query, key, value = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        batch = mixed.shape[0]
        query = query.reshape(batch, steps, -1, layer.head_k_dim)
        key = key.reshape(batch, steps, -1, layer.head_k_dim)
        value = value.reshape(batch, steps, -1, layer.head_v_dim)
        keep = torch.arange(steps, device=kept.device)[None] < kept[:, None]  # [B, T]
        beta = capture.b.sigmoid() * keep[..., None]
        g = (-layer.A_log.float().exp() * F.softplus(capture.a.float() + layer.dt_bias)) * keep[..., None]
        # The layer's own kernels. A verify is a few tokens: the chunked kernel pads them to a 64-token chunk and
        # solves a triangular system, the recurrent one does `steps` small updates (4x cheaper at 2-8 tokens on CPU).
        kernels = sys.modules[type(layer).__module__]
        kernel_fn = (
            kernels.torch_recurrent_gated_delta_rule
            if steps <= RECURRENT_MAX_STEPS
            else kernels.torch_chunk_gated_delta_rule
        )
        _, state = kernel_fn(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return state
