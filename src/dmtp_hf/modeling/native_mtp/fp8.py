"""Block-scaled FP8 weights (DeepSeek-V3/R1 and GLM FP8 releases): dequantize MTP tensors on load.

Those checkpoints store a linear weight ``W [out, in]`` as ``*.weight`` in ``float8_e4m3fn`` plus
``*.weight_scale_inv [ceil(out / bo), ceil(in / bi)]`` (float32), with ``(bo, bi)`` =
``config.quantization_config.weight_block_size`` (``[128, 128]`` in the releases). The real weight is
``W = fp8.float() * scale_inv`` with each scale broadcast over its ``bo x bi`` block. The MTP head is small, so it
is dequantized once at load time; the scales are consumed here and never loaded as weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "FP8_DTYPES",
    "SCALE_SUFFIX",
    "dequantize_block_fp8",
    "dequantize_fp8_state_dict",
    "fp8_block_size",
    "quantize_block_fp8",
]

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
# Suffix of the per-block inverse scales in DeepSeek-style FP8 checkpoints (``x.weight`` -> ``x.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(quantization_config: Any) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a (dict or object) quantization config, or None when absent."""
    if quantization_config is None:
        return None
    if isinstance(quantization_config, Mapping):
        block = quantization_config.get("weight_block_size")
    else:
        block = getattr(quantization_config, "weight_block_size", None)
    if block is None:
        return None
    if len(block) != 2:
        raise ValueError(f"`weight_block_size` must have two entries [rows, cols], got {block}")
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a block-scaled FP8 weight: ``weight.float() * scale_inv`` expanded over ``block_size`` blocks.

    Args:
        weight: ``[..., out, in]`` in an FP8 dtype (leading dims, if any, are e.g. fused experts).
        scale_inv: ``[..., ceil(out / block_size[0]), ceil(in / block_size[1])]``.
        block_size: ``(rows, cols)`` of one scaling block.
        dtype: Output dtype.
    """
    rows, cols = int(block_size[0]), int(block_size[1])
    out_features, in_features = weight.shape[-2:]
    expected = (-(-out_features // rows), -(-in_features // cols))
    if tuple(scale_inv.shape[-2:]) != expected or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(
            f"FP8 scale shape {tuple(scale_inv.shape)} does not match weight shape {tuple(weight.shape)} with "
            f"block size {[rows, cols]} (expected trailing dims {expected})"
        )
    scale = scale_inv.float().repeat_interleave(rows, dim=-2)[..., :out_features, :]
    scale = scale.repeat_interleave(cols, dim=-1)[..., :in_features]
    return (weight.float() * scale).to(dtype)


def dequantize_fp8_state_dict(
    tensors: dict[str, torch.Tensor], block_size: Sequence[int] | None
) -> dict[str, torch.Tensor]:
    """Replace every FP8 ``*.weight`` + ``*.weight_scale_inv`` pair of ``tensors`` by the dequantized weight.

    Raises a `ValueError` naming the tensors when an FP8 weight has no scale, a scale has no FP8 weight, or the
    block size is unknown; never lets a scale through as if it were a weight.
    """
    scales = {name for name in tensors if name.endswith(SCALE_SUFFIX)}
    fp8_weights = {name for name, tensor in tensors.items() if tensor.dtype in FP8_DTYPES}
    if not scales and not fp8_weights:
        return tensors
    orphan_weights = sorted(name for name in fp8_weights if name + SCALE_SUFFIX not in scales)
    orphan_scales = sorted(name for name in scales if name[: -len(SCALE_SUFFIX)] not in fp8_weights)
    if orphan_weights or orphan_scales:
        raise ValueError(
            "Unsupported FP8 MTP weights: only block-scaled FP8 (`*.weight` in float8 with `*.weight_scale_inv`) "
            f"is supported. FP8 tensors without a scale: {orphan_weights}; scales without an FP8 weight: "
            f"{orphan_scales}."
        )
    if block_size is None:
        raise ValueError(
            f"The MTP tensors are block-scaled FP8 ({len(fp8_weights)} weights, e.g. {sorted(fp8_weights)[0]!r}) "
            "but the block size is unknown: the target config has no `quantization_config.weight_block_size`. "
            "Pass `fp8_block_size=(rows, cols)` to the loader."
        )
    result = {name: tensor for name, tensor in tensors.items() if name not in scales}
    for name in fp8_weights:
        result[name] = dequantize_block_fp8(tensors[name], tensors[name + SCALE_SUFFIX], block_size)
    return result


def quantize_block_fp8(
    weight: torch.Tensor, block_size: Sequence[int], dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 quantization as the DeepSeek FP8 releases store it: ``(fp8 weight, scale_inv)``.

    The inverse of `dequantize_block_fp8`: each ``rows x cols`` block is scaled so its largest magnitude maps to the
    format's maximum. ``weight`` is ``[..., out, in]``; ``scale_inv`` is ``[..., ceil(out / rows), ceil(in / cols)]``.
    """
    rows, cols = int(block_size[0]), int(block_size[1])
    *lead, out_features, in_features = weight.shape
    blocks_r, blocks_c = -(-out_features // rows), -(-in_features // cols)
    padded = weight.new_zeros(*lead, blocks_r * rows, blocks_c * cols, dtype=torch.float32)
    padded[..., :out_features, :in_features] = weight.float()
    tiles = padded.view(*lead, blocks_r, rows, blocks_c, cols)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / torch.finfo(dtype).max  # [..., br, bc]
    quantized = (tiles / scale[..., :, None, :, None]).view_as(padded)[..., :out_features, :in_features]
    return quantized.to(dtype).contiguous(), scale.contiguous()
