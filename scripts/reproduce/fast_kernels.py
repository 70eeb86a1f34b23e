"""Faster pure-PyTorch GatedDeltaNet kernels for *training* the bundled target on CPU (same math as Transformers').

Without ``causal-conv1d`` / ``flash-linear-attention`` (CPU machines), Transformers falls back to reference kernels
whose backward passes dominate a training step on CPU: the depthwise ``F.conv1d`` backward (oneDNN) and the batched
``torch.linalg.solve_triangular`` of the chunked delta rule. `fast_gated_delta_kernels` swaps in equivalent
formulations for the duration of a ``with`` block:

- causal depthwise conv as a sum of ``kernel_size`` shifted products (4 multiply-adds, trivially differentiable);
- the unit-lower-triangular solve of each chunk as a product of ``log2(chunk)`` matmuls,
  ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)...`` (``N`` strictly lower triangular, hence nilpotent), on chunks of
  32 tokens instead of 64.

Only the functions used by the cache-free (training) path are replaced; anything with a cache, and every saved or
loaded checkpoint, uses Transformers' own code. The test suite checks both give the same outputs and gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

__all__ = ["causal_conv1d_shifted", "chunk_gated_delta_rule_matmul", "fast_gated_delta_kernels"]


def causal_conv1d_shifted(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs,
) -> torch.Tensor:
    """Causal depthwise conv of ``[B, C, T]`` with ``weight [C, K]``: ``out[t] = sum_k w[k] x[t + k - K + 1]``."""
    seq_len, kernel_size = hidden_states.shape[-1], weight.shape[-1]
    padded = F.pad(hidden_states.to(weight.dtype), (kernel_size - 1, 0))
    out = sum(weight[:, k, None] * padded[..., k : k + seq_len] for k in range(kernel_size))
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # as Transformers / FLA


def _unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """``(I + N)^-1`` for strictly lower-triangular ``N [..., n, n]``: ``prod_i (I + (-N)^(2^i))`` (N^n = 0)."""
    size = strict_lower.shape[-1]
    eye = torch.eye(size, dtype=strict_lower.dtype, device=strict_lower.device)
    power = -strict_lower
    inverse = eye + power
    span = 2
    while span < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        span *= 2
    return inverse


def chunk_gated_delta_rule_matmul(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 32,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transformers' ``torch_chunk_gated_delta_rule`` with the triangular solve done by matmuls (same signature).

    Chunks of 32 rather than 64: the result does not depend on the chunking, and on CPU the cubic per-chunk work
    (``chunk^3 / chunk`` per token) costs more than the longer sequential scan saves.
    """
    initial_dtype = query.dtype
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    num_chunks = (sequence_length + pad) // chunk_size

    v_beta, k_beta = value * beta[..., None], key * beta[..., None]
    query, key, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], num_chunks, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    )
    cum_decay = decay.reshape(decay.shape[0], decay.shape[1], num_chunks, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise_decay = (cum_decay[..., :, None] - cum_decay[..., None, :]).masked_fill(upper, float("-inf")).exp()

    # Strictly lower part of the UT system (the solve is unit-triangular: its diagonal is ignored).
    ut_strict = ((k_beta @ key.transpose(-1, -2)) * pairwise_decay).tril(-1)
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    inverse = _unit_lower_inverse(ut_strict)
    new_values = inverse @ v_beta
    k_cumdecay = inverse @ (k_beta * cum_decay.exp()[..., None])

    state = (
        torch.zeros(batch_size, num_v_heads, k_head_dim, v_head_dim, dtype=new_values.dtype, device=query.device)
        if initial_state is None
        else initial_state.to(new_values)
    )
    query = query * cum_decay.exp()[..., None]
    key = key * (cum_decay[..., -1:] - cum_decay).exp()[..., None]
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    core_attn_out = torch.stack(outputs, dim=2).reshape(batch_size, num_v_heads, -1, v_head_dim)
    core_attn_out = core_attn_out[:, :, :sequence_length].transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, state if output_final_state else None


@contextlib.contextmanager
def fast_gated_delta_kernels(enabled: bool = True) -> Iterator[None]:
    """Use `causal_conv1d_shifted` / `chunk_gated_delta_rule_matmul` in Qwen3.5 GatedDeltaNet layers inside the block.

    Replaces the module-level fallbacks of ``transformers.models.qwen3_5.modeling_qwen3_5`` and restores them on
    exit (not thread-safe: meant for a single-threaded training loop).
    """
    if not enabled:
        yield
        return
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    saved = module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule
    module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = causal_conv1d_shifted, chunk_gated_delta_rule_matmul
    try:
        yield
    finally:
        module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = saved
