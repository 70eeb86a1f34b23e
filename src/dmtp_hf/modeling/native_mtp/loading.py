"""Find the native MTP tensors in the target's own checkpoint, map them onto `NativeMTPHead`, and load them.

Transformers drops MTP tensors when it loads a target (``_keys_to_ignore_on_load_unexpected``), so they are read
here straight from the checkpoint's safetensors files: a single ``model.safetensors``, or the shards listed in
``model.safetensors.index.json``, of which only those holding MTP tensors are opened.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from ...local_paths import require_local_folder
from ..configuration_dmtp import require_local_directory
from ..draft_vocab import DRAFT_VOCAB_TENSORS
from ..io import check_finite
from .fp8 import dequantize_fp8_state_dict
from .fp8 import fp8_block_size as block_size_of
from .head import HiddenInput, NativeMTPHead
from .layouts import MTPLayout, resolve_mtp_layout

__all__ = [
    "MissingMTPTensorsError",
    "NoNativeMTPError",
    "checkpoint_to_head_state_dict",
    "load_native_mtp",
    "load_target_checkpoint",
    "mtp_ignore_patterns",
    "read_mtp_tensors",
]

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# A checkpoint expert tensor stored per expert: `<...>.experts.<e>.<gate|up|down>_proj.weight`.
_PER_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class NoNativeMTPError(ValueError):
    """The target has no native MTP head (its config declares 0 MTP layers, or its checkpoint holds none)."""


class MissingMTPTensorsError(ValueError):
    """The checkpoint holds an MTP head, but some tensors the head needs are absent."""


# ----------------------------------------------------------------------------------------------------------------
# Files


def _resolve_file(checkpoint: str | os.PathLike, filename: str) -> str | None:
    """Local path of ``filename`` in a checkpoint directory or Hub repo, or None when it does not exist."""
    if Path(checkpoint).is_dir():
        path = Path(checkpoint) / filename
        return str(path) if path.is_file() else None
    from transformers.utils import cached_file

    return cached_file(
        str(checkpoint),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def _read_checkpoint_config(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    path = _resolve_file(checkpoint, CONFIG_NAME)
    if path is None:
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_mtp_tensors(checkpoint: str | os.PathLike, prefix: str) -> dict[str, torch.Tensor]:
    """Read every tensor whose name starts with ``prefix`` from a safetensors checkpoint (local dir or Hub repo).

    With a sharded checkpoint only the shards that the index lists for such tensors are opened (and, from the Hub,
    downloaded). Returns ``{name without prefix: tensor}`` on CPU, in the stored dtype.
    """
    index_file = _resolve_file(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    shards: dict[str, list[str] | None] = defaultdict(list)
    if index_file is not None:
        with open(index_file, encoding="utf-8") as handle:
            weight_map: dict[str, str] = json.load(handle)["weight_map"]
        for name, shard in weight_map.items():
            if name.startswith(prefix):
                shards[shard].append(name)
    elif _resolve_file(checkpoint, SAFE_WEIGHTS_NAME) is not None:
        shards[SAFE_WEIGHTS_NAME] = None  # a single file: its own key list decides
    else:
        raise FileNotFoundError(
            f"No safetensors checkpoint ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}) found in {checkpoint!s}"
        )

    tensors = {}
    for shard, names in shards.items():
        path = _resolve_file(checkpoint, shard)
        if path is None:
            raise FileNotFoundError(f"Shard {shard} listed in {SAFE_WEIGHTS_INDEX_NAME} is missing from {checkpoint!s}")
        with safe_open(path, framework="pt", device="cpu") as handle:
            if names is None:
                names = [name for name in handle.keys() if name.startswith(prefix)]
            for name in names:
                tensors[name[len(prefix) :]] = handle.get_tensor(name)
    return tensors


# ----------------------------------------------------------------------------------------------------------------
# Names


def _fuse_experts(
    state_dict: dict[str, torch.Tensor], expected: Mapping[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Stack per-expert checkpoint tensors into fused parameters where the module has them.

    ``experts.{e}.gate_proj/up_proj.weight [I, H]`` -> ``experts.gate_up_proj [E, 2I, H]`` (gate rows first, as
    Transformers' ``MergeModulelist(dim=0)`` + ``Concatenate(dim=1)``), ``experts.{e}.down_proj.weight [H, I]`` ->
    ``experts.down_proj [E, H, I]``. Returns the new state dict and the names of missing expert tensors.
    """
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    result = {}
    for name, tensor in state_dict.items():
        match = _PER_EXPERT.match(name)
        if match and f"{match['experts']}.gate_up_proj" in expected:
            grouped[match["experts"]][match["proj"]][int(match["index"])] = tensor
        else:
            result[name] = tensor

    missing = []
    for experts, projections in grouped.items():
        num_experts = expected[f"{experts}.gate_up_proj"][0]
        absent = [
            f"{experts}.{e}.{proj}.weight"
            for proj in ("gate_proj", "up_proj", "down_proj")
            for e in range(num_experts)
            if e not in projections[proj]
        ]
        if absent:
            # Report the absent per-expert tensors (not the fused names, which the checkpoint never has).
            missing += absent
            result[f"{experts}.gate_up_proj"] = result[f"{experts}.down_proj"] = None
            continue
        gate, up, down = (projections[p] for p in ("gate_proj", "up_proj", "down_proj"))
        result[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([gate[e], up[e]], dim=0) for e in range(num_experts)]
        )
        result[f"{experts}.down_proj"] = torch.stack([down[e] for e in range(num_experts)])
    return result, missing


def checkpoint_to_head_state_dict(
    tensors: Mapping[str, torch.Tensor], layout: MTPLayout, expected: Mapping[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Rename checkpoint MTP tensors (names relative to the layout prefix) to `NativeMTPHead` state-dict names.

    Args:
        tensors: ``{checkpoint name without prefix: tensor}``, already dequantized.
        layout: The family layout.
        expected: ``{head state-dict name: shape}`` of the head being loaded.

    Returns:
        ``(state_dict, missing, ignored)``: the renamed tensors, the expected names nothing mapped to (plus
        absent per-expert tensors), and the checkpoint names that were skipped (shared copies, extra layers).
    """
    state_dict, ignored = {}, []
    for name, tensor in tensors.items():
        target_name = None
        for part, checkpoint_name in layout.tensor_names.items():
            if name.startswith(checkpoint_name + "."):
                target_name = part + name[len(checkpoint_name) :]
                break
        if name in DRAFT_VOCAB_TENSORS:  # a draft vocabulary (head checkpoints of `save_mtp_head`)
            target_name = name
        if target_name is None and any(name.startswith(skip + ".") for skip in layout.ignored):
            ignored.append(name)
            continue
        if target_name is None and name.startswith(layout.block_prefix):
            target_name = "layer." + name[len(layout.block_prefix) :]
        if target_name is None:
            ignored.append(name)
            continue
        state_dict[target_name] = tensor

    state_dict, missing_experts = _fuse_experts(state_dict, expected)
    missing = sorted(set(expected) - set(state_dict)) + missing_experts
    state_dict = {name: tensor for name, tensor in state_dict.items() if tensor is not None}
    return state_dict, missing, ignored


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def _checkpoint_name(head_name: str, layout: MTPLayout, prefix: str) -> str:
    """The checkpoint name a head state-dict name is loaded from (for error messages)."""
    part, _, rest = head_name.partition(".")
    if part in layout.tensor_names:
        return f"{prefix}{layout.tensor_names[part]}.{rest}"
    return f"{prefix}{layout.block_prefix}{rest}" if part == "layer" else head_name


def _keep_in_fp32_pattern(target: PreTrainedModel) -> re.Pattern | None:
    names = list(getattr(target, "_keep_in_fp32_modules_strict", None) or [])
    names += list(getattr(target, "_keep_in_fp32_modules", None) or [])
    return re.compile("|".join(re.escape(name) for name in names)) if names else None


def load_native_mtp(
    target: PreTrainedModel,
    checkpoint: str | os.PathLike | None = None,
    *,
    layout: MTPLayout | None = None,
    hidden_input: HiddenInput = "post_norm",
    fp8_block_size: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> NativeMTPHead:
    """Build the target's native MTP head and load its weights from the target's own checkpoint.

    Args:
        target: The loaded target model (e.g. ``AutoModelForCausalLM.from_pretrained(path)``).
        checkpoint: Local directory or Hub repo of the target checkpoint; defaults to the path the target was
            loaded from (``target.config._name_or_path``).
        layout: Force a family layout instead of resolving it from the configs (see `register_mtp_layout`).
        hidden_input: ``"post_norm"`` (default) or ``"pre_norm"`` target hidden input (see `NativeMTPHead`).
        fp8_block_size: Block size of block-scaled FP8 MTP weights; defaults to the target's (or the checkpoint's)
            ``quantization_config.weight_block_size``.
        dtype: Dtype of the head; defaults to the dtype of the target's input embedding. Modules the target keeps in
            float32 (``_keep_in_fp32_modules(_strict)``, e.g. MoE routers) stay in float32.
        device: Device of the head; defaults to the device of the target's LM head.

    Raises:
        UnsupportedMTPFamilyError: no layout is registered for the target's family.
        NoNativeMTPError: the config declares 0 MTP layers, or the checkpoint holds no MTP tensors.
        MissingMTPTensorsError: some MTP tensors are absent (the message lists them).
        ValueError: tensor shapes or names that do not fit the head, or unsupported/undescribed FP8 weights.
        FileNotFoundError: no checkpoint to read (the target records no path, or the path holds no safetensors).
    """
    checkpoint = checkpoint or getattr(target.config, "_name_or_path", None) or getattr(target, "name_or_path", None)
    if not checkpoint:
        raise FileNotFoundError("The target does not record where it was loaded from: pass `checkpoint=`")
    require_local_directory(checkpoint)  # a missing local folder, not "invalid Hub repo id"
    checkpoint_config = _read_checkpoint_config(checkpoint)
    checkpoint_text_config = (checkpoint_config or {}).get("text_config")
    text_config = target.config.get_text_config(decoder=True)
    if layout is None:
        layout = resolve_mtp_layout(target.config, text_config, checkpoint_config, checkpoint_text_config)
    configs = (target.config, text_config, checkpoint_config, checkpoint_text_config)
    tensors = _read_head_tensors(checkpoint, layout, configs, fp8_block_size)

    # Built on the meta device (a real MoE MTP layer is billions of parameters: never materialize it twice). The
    # device context is thread-local, unlike accelerate's init_empty_weights, which patches nn.Module process-wide.
    with torch.device("meta"):
        head = NativeMTPHead(target, layout, hidden_input=hidden_input)
        if "d2t" in tensors:  # filled from the checkpoint below
            head.use_draft_vocabulary(tensors["d2t"].numel())
    state_dict = _head_state_dict(head, tensors, layout, checkpoint)
    dtype = dtype or target.get_input_embeddings().weight.dtype
    device = device or target.get_output_embeddings().weight.device
    keep_fp32 = _keep_in_fp32_pattern(target)
    for name, tensor in state_dict.items():
        tensor_dtype = dtype
        if not tensor.is_floating_point():
            tensor_dtype = tensor.dtype
        elif keep_fp32 is not None and keep_fp32.search(name):
            tensor_dtype = torch.float32
        state_dict[name] = tensor.to(device=device, dtype=tensor_dtype)
    check_finite(state_dict.items(), f"The {layout.name} MTP head in {checkpoint!s}")
    head.load_state_dict(state_dict, strict=True, assign=True)
    unloaded = [name for name, tensor in [*head.named_parameters(), *head.named_buffers()] if tensor.is_meta]
    if unloaded:
        raise ValueError(f"The {layout.name} MTP head has tensors no checkpoint entry fills: {unloaded}")
    head.to(device)
    head.requires_grad_(False)
    return head.eval()


def _read_head_tensors(checkpoint, layout: MTPLayout, configs: tuple, fp8_block_size) -> dict[str, torch.Tensor]:
    """The head's checkpoint tensors (dequantized when FP8), after checking the configs declare a head at all."""
    _, text_config, checkpoint_config, checkpoint_text_config = configs
    num_layers = layout.num_mtp_layers(text_config)
    for raw in (checkpoint_text_config, checkpoint_config):
        if num_layers is None and raw is not None:
            num_layers = next((int(raw[k]) for k in layout.num_layers_keys if raw.get(k) is not None), None)
    if num_layers == 0:
        raise NoNativeMTPError(
            f"The target ({layout.name}) has no native MTP head: its config declares 0 MTP layers "
            f"({' / '.join(layout.num_layers_keys)} = 0)."
        )

    prefix = layout.checkpoint_prefix(text_config)
    tensors = read_mtp_tensors(checkpoint, prefix)
    if not tensors:
        raise NoNativeMTPError(
            f"The target ({layout.name}) has no native MTP head: no tensor named {prefix}* in the checkpoint "
            f"{checkpoint!s}."
        )
    if fp8_block_size is None:
        for config in configs:
            quantization_config = (
                config.get("quantization_config")
                if isinstance(config, Mapping)
                else getattr(config, "quantization_config", None)
            )
            fp8_block_size = fp8_block_size or block_size_of(quantization_config)
    return dequantize_fp8_state_dict(tensors, fp8_block_size)


def _head_state_dict(head: NativeMTPHead, tensors, layout: MTPLayout, checkpoint) -> dict[str, torch.Tensor]:
    """Checkpoint tensors renamed into ``head``'s state dict; every tensor accounted for, every shape right."""
    prefix = head.checkpoint_prefix
    expected = {name: tensor.shape for name, tensor in head.state_dict().items()}
    state_dict, missing, ignored = checkpoint_to_head_state_dict(tensors, layout, expected)
    if missing:
        missing = [_checkpoint_name(name, layout, prefix) for name in missing]
        raise MissingMTPTensorsError(
            f"The {layout.name} MTP head in {checkpoint!s} is incomplete: {len(missing)} checkpoint tensor(s) "
            f"missing: {missing}"
        )
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise ValueError(f"MTP tensors under {prefix!r} that the {layout.name} head has no place for: {unexpected}")
    mismatched = [
        f"{name}: checkpoint {tuple(tensor.shape)} vs head {tuple(expected[name])}"
        for name, tensor in state_dict.items()
        if tensor.shape != expected[name]
    ]
    if mismatched:
        raise ValueError(f"MTP tensor shapes do not match the {layout.name} head: {mismatched}")
    if ignored:
        logger.info("Ignored MTP checkpoint tensors (shared copies or unused layers): %s", ignored)
    return state_dict


# ---------------------------------------------------------------------------------------------------------------
# Loading the target itself


def mtp_ignore_patterns(config: PreTrainedConfig) -> list[str] | None:
    """Regexes matching the MTP keys of a DeepSeek/GLM/MiMo checkpoint of any depth (None: the class's own are right).

    Transformers hard-codes DeepSeek-V3's as ``model\\.layers\\.61.*`` and GLM's as ``model\\.layers\\.92.*`` /
    ``model\\.layers\\.46.*``; a tiny target has its MTP layer at ``model.layers.{num_hidden_layers}``.
    """
    text_config = config.get_text_config(decoder=True)
    if text_config.model_type in ("deepseek_v3", "glm4_moe"):
        return [rf"model\.layers\.{text_config.num_hidden_layers}\..*"]
    if "MiMoForCausalLM" in (getattr(config, "architectures", None) or ()):
        return [r"model\.mtp_layers\..*"]
    return None


def load_target_checkpoint(path: str | os.PathLike, **kwargs: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` (eval mode) that skips MTP tensors at any depth.

    Transformers hard-codes the MTP ignore regex of DeepSeek-V3/GLM at the release depth; checkpoints of other depths
    (distilled, pruned, the tests' tiny ones) would warn about or mis-report those keys. The returned instance keeps
    the fitted ``_keys_to_ignore_on_load_unexpected`` (see `mtp_ignore_patterns`), which is where Transformers'
    ``MtpModel.from_pretrained`` (``use_mtp=True``) looks for the MTP keys. The instance's class is a subclass of the
    Transformers class that only carries those patterns. A missing folder that can only be local raises
    ``FileNotFoundError`` before any Hub call.
    """
    require_local_folder(path, "target checkpoint")  # a mistyped local path, not a minute of Hub retries
    config = AutoConfig.from_pretrained(path)
    patterns = mtp_ignore_patterns(config)
    if patterns is None:
        return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs).eval()
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    # A subclass carries the fitted patterns: the Transformers class itself is never changed.
    fitted = type(
        model_class.__name__,
        (model_class,),
        {"_keys_to_ignore_on_load_unexpected": patterns, "__module__": model_class.__module__},
    )
    return fitted.from_pretrained(path, config=config, **kwargs).eval()
