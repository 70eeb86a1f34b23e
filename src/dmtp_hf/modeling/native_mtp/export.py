"""Write MTP heads to disk: a small standalone head checkpoint, or a whole target checkpoint with a new head.

- :func:`save_mtp_head` writes ``config.json`` (``dmtp_mtp_head``: layout, hidden input, target shape) and
  ``model.safetensors`` holding the head's tensors under the *target's* checkpoint names. ``load_native_mtp(target,
  checkpoint=DIR)`` reads it through the same code as a target checkpoint. Retrofitted heads (targets without an MTP
  head of their own, e.g. Llama) use the ``retrofit`` layout: Qwen-style ``mtp.*`` names.
- :func:`export_mtp_into_target` (``dmtp export-mtp``) writes a new target directory in which only the MTP tensors
  change: written in the target's own names and dtypes (block-scaled FP8 re-quantized, per-expert or stacked MoE
  experts as the target stores them) into a new shard ``model-mtp.safetensors``, with
  ``model.safetensors.index.json`` updated; shards without MTP tensors are hard-linked (copied across file
  systems), the others rewritten without their MTP tensors; config, tokenizer and every other file are copied
  untouched. Those names are the ones vLLM and SGLang read for MTP speculative decoding: ``mtp.*`` (Qwen3.5,
  Qwen3-Next), ``model.layers.{num_hidden_layers}.*`` (DeepSeek-V3, GLM), ``model.mtp_layers.*`` (MiMo).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..draft_vocab import DRAFT_VOCAB_TENSORS
from ..io import atomic_directory
from .fp8 import FP8_DTYPES, SCALE_SUFFIX, fp8_block_size, quantize_block_fp8
from .head import NativeMTPHead
from .loading import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, read_mtp_tensors

__all__ = ["HEAD_CONFIG_KEY", "MTP_SHARD", "export_mtp_into_target", "head_checkpoint_tensors", "save_mtp_head"]

HEAD_CONFIG_KEY = "dmtp_mtp_head"
MTP_SHARD = "model-mtp.safetensors"
_FUSED_EXPERTS = re.compile(r"^(?P<experts>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def head_checkpoint_tensors(
    head: NativeMTPHead, per_expert: bool = False, prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """The head's tensors under the target's checkpoint names (relative to the layout prefix unless ``prefix``).

    ``per_expert`` splits fused MoE experts (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)
    into ``experts.{e}.{gate,up,down}_proj.weight``, as DeepSeek/GLM/Qwen3-Next releases store them.
    """
    layout = head.layout
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        part, _, rest = name.partition(".")
        tensor = tensor.detach().contiguous()
        if name in DRAFT_VOCAB_TENSORS:  # a draft vocabulary: the same names as a draft's, under the prefix
            out[name] = tensor
            continue
        if part in layout.tensor_names:
            out[f"{layout.tensor_names[part]}.{rest}"] = tensor
            continue
        if part != "layer":
            raise ValueError(f"head tensor {name!r} has no checkpoint name in the {layout.name} layout")
        fused = _FUSED_EXPERTS.match(rest)
        if per_expert and fused:
            experts = f"{layout.block_prefix}{fused['experts']}"
            if fused["proj"] == "gate_up_proj":
                intermediate = tensor.shape[1] // 2
                for e in range(tensor.shape[0]):
                    out[f"{experts}.{e}.gate_proj.weight"] = tensor[e, :intermediate].contiguous()
                    out[f"{experts}.{e}.up_proj.weight"] = tensor[e, intermediate:].contiguous()
            else:
                for e in range(tensor.shape[0]):
                    out[f"{experts}.{e}.down_proj.weight"] = tensor[e].contiguous()
            continue
        out[f"{layout.block_prefix}{rest}"] = tensor
    return out if prefix is None else {prefix + name: tensor for name, tensor in out.items()}


def save_mtp_head(head: NativeMTPHead, directory: str | os.PathLike, target: Any, **extra: Any) -> Path:
    """Write ``head`` as a standalone head checkpoint (see the module docstring); atomic. Returns the directory."""
    text_config = target.config.get_text_config(decoder=True)
    tensors = head_checkpoint_tensors(head, prefix=head.checkpoint_prefix)
    config = {
        HEAD_CONFIG_KEY: {
            "layout": head.layout.name,
            "hidden_input": head.hidden_input,
            "target_model_type": text_config.model_type,
            "num_hidden_layers": text_config.num_hidden_layers,
            "hidden_size": text_config.hidden_size,
            "vocab_size": text_config.vocab_size,
            "draft_vocab_size": None if head.d2t is None else head.d2t.numel(),
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
            **extra,
        }
    }
    with atomic_directory(directory) as tmp:
        save_file(tensors, str(tmp / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(directory)


# ----------------------------------------------------------------------------------------------------------------
# Into the target's own checkpoint


def _weight_map(target_dir: Path) -> dict[str, str]:
    index = target_dir / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = target_dir / SAFE_WEIGHTS_NAME
    if not single.is_file():
        raise FileNotFoundError(f"{target_dir} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), SAFE_WEIGHTS_NAME)


def _new_mtp_tensors(head: NativeMTPHead, original: dict[str, torch.Tensor], block_size) -> dict[str, torch.Tensor]:
    """The target's MTP tensors (names relative to the prefix) with the head's values, in the original dtypes."""
    per_expert = any(".experts.0." in name for name in original)
    new = head_checkpoint_tensors(head, per_expert=per_expert)
    unknown = sorted(set(new) - set(original))
    if unknown:
        raise ValueError(f"The head does not match the target: it has tensors the target's MTP head has not: {unknown}")
    result = dict(original)  # shared copies (embedding, LM head) and anything the head does not own stay as they are
    for name, tensor in new.items():
        stored = original[name]
        if tuple(stored.shape) != tuple(tensor.shape):
            raise ValueError(
                f"The head does not match the target: {name} is {tuple(tensor.shape)} in the head, "
                f"{tuple(stored.shape)} in the target checkpoint."
            )
        if stored.dtype in FP8_DTYPES:
            if block_size is None:
                raise ValueError(f"{name} is FP8 in the target but its config has no weight_block_size")
            result[name], result[name + SCALE_SUFFIX] = quantize_block_fp8(tensor, block_size, stored.dtype)
        else:
            result[name] = tensor.to(stored.dtype)
    return result


def _link_or_copy(source: Path, destination: Path) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def export_mtp_into_target(head: NativeMTPHead, target_dir: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """Write ``output_dir``: the checkpoint in ``target_dir`` with its MTP tensors replaced by ``head``'s.

    Raises ``ValueError`` (naming the tensors) when the head does not match the target's MTP head or has a draft
    vocabulary, and ``FileNotFoundError`` when ``target_dir`` has no MTP tensors or no safetensors checkpoint.
    """
    if head.d2t is not None:
        raise ValueError(
            "This head predicts over a draft vocabulary, which serving engines do not read from a target's MTP "
            "tensors: save it as a head checkpoint (save_mtp_head), or train it over the full vocabulary."
        )
    source, prefix = Path(target_dir), head.checkpoint_prefix
    config = json.loads((source / "config.json").read_text())
    original = read_mtp_tensors(source, prefix)
    if not original:
        raise FileNotFoundError(f"{source} has no MTP tensors under {prefix!r}: nothing to replace")
    block_size = fp8_block_size(config.get("quantization_config"))
    tensors = _new_mtp_tensors(head, original, block_size)

    weight_map = _weight_map(source)
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in weight_map.items():
        by_shard[shard].append(name)
    new_map: dict[str, str] = {}
    with atomic_directory(output_dir) as tmp:
        for item in source.iterdir():
            if item.name == SAFE_WEIGHTS_INDEX_NAME or item.name in by_shard or item.name.startswith("."):
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        for shard, names in by_shard.items():
            trunk = [n for n in names if not n.startswith(prefix)]
            # A single-file checkpoint becomes a sharded one: its trunk keeps its own file, under an index.
            name = "model-trunk.safetensors" if shard == SAFE_WEIGHTS_NAME else shard
            if len(trunk) == len(names):
                _link_or_copy(source / shard, tmp / name)
            elif trunk:
                with safe_open(str(source / shard), framework="pt") as handle:
                    save_file({n: handle.get_tensor(n) for n in trunk}, str(tmp / name), metadata={"format": "pt"})
            new_map.update(dict.fromkeys(trunk, name))
        save_file({prefix + n: t for n, t in tensors.items()}, str(tmp / MTP_SHARD), metadata={"format": "pt"})
        new_map.update(dict.fromkeys((prefix + n for n in tensors), MTP_SHARD))
        size = sum((tmp / f).stat().st_size for f in set(new_map.values()))
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(new_map.items()))}
        (tmp / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return Path(output_dir)
