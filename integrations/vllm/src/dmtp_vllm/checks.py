"""Refuse a draft folder vLLM cannot run, before vLLM loads the target.

vLLM reads a speculative draft only after it has loaded the target's weights (minutes for a large target), and then
fails vaguely: a dmtp-hf folder that was never converted is "model type `dmtp` not recognized" by Transformers, a
draft trained for another target is a weight-shape error deep in the loader, and a truncated safetensors file is a
safetensors error that names no file. `check_draft` reads only JSON and safetensors headers (no torch, no weights),
so the plugin runs it when vLLM builds its speculative config (`hook.install`), and says what to do instead.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["DraftFolderError", "check_draft", "check_safetensors_file", "target_text_config"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Targets whose vLLM model hands no captured layers to a DFlash drafter (its context features, and DMTP's last
# layer): vLLM 0.32 starts such an engine and fails at its first step (MiMo: "too many values to unpack") or after
# loading the target (GLM: "Model does not support EAGLE3 interface").
TARGETS_WITHOUT_CAPTURED_LAYERS = {
    "MiMoForCausalLM": "its MiMoModel.forward (models/mimo.py) replaces Qwen2Model.forward without the captured layers",
    "Glm4MoeForCausalLM": "Glm4MoeForCausalLM (models/glm4_moe.py) does not implement SupportsEagle3",
}


class DraftFolderError(ValueError):
    """A speculative draft folder that this vLLM and target cannot run; the message says what to do."""


def _read_config(folder: Path, role: str) -> dict[str, Any]:
    """``folder/config.json`` as a dict; a missing or unreadable one is a `DraftFolderError` naming ``role``."""
    path = folder / "config.json"
    if not path.is_file():
        raise DraftFolderError(f"The {role} folder {folder} has no config.json.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DraftFolderError(f"The {role} config {path} cannot be read as JSON: {error}") from error


def target_text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a target config (multimodal targets nest it under ``text_config``)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) and "hidden_size" in text else config


def _refuse_targets_without_captured_layers(target_config: Mapping[str, Any], target: str) -> None:
    """A target in `TARGETS_WITHOUT_CAPTURED_LAYERS`: no DFlash-family draft runs on it in this vLLM."""
    for architecture in target_config.get("architectures") or []:
        reason = TARGETS_WITHOUT_CAPTURED_LAYERS.get(architecture)
        if reason is not None:
            raise DraftFolderError(
                f"The target {target} ({architecture}) cannot serve a DFlash or DMTP draft in this vLLM: {reason}, "
                "and these drafts read the target's layers. Serve it with vLLM's own `mtp` method, or DMTP in "
                "Transformers (`target.generate(..., assistant_model=draft)`)."
            )


def _refuse_unconverted(draft: Path, config: Mapping[str, Any], target: str) -> None:
    """A folder in dmtp-hf's own format (``model_type: dmtp``) is not one vLLM reads: say which export it needs."""
    if config.get("model_type") != "dmtp":
        return
    layout = (config.get("dmtp_config") or {}).get("anchor_layout", config.get("anchor_layout"))
    out = f"{draft}-vllm"
    if layout == "dflash":
        raise DraftFolderError(
            f"{draft} is a DFlash draft saved by dmtp-hf (model_type 'dmtp'), which vLLM cannot load. Export it "
            f'first: `dmtp convert {draft} {out} --to dflash`, then pass {out} as the "model" of '
            '`"method": "dflash"` (vLLM\'s own DFlash runs it).'
        )
    raise DraftFolderError(
        f"{draft} is a DMTP draft saved by dmtp-hf (model_type 'dmtp'), not converted for vLLM. Convert it "
        f"first: `dmtp convert {draft} {out} --to vllm --target {target}` (add `--mtp-head HEAD` when its MTP head "
        f'was retrofitted, for a target that ships none), then pass {out} as the speculative config\'s "model".'
    )


def _field_mismatches(draft_config: Mapping[str, Any], target_config: Mapping[str, Any]) -> list[str]:
    """What in a DFlash or DMTP-for-vLLM draft config contradicts the target's config, one line per field."""
    text = target_text_config(target_config)
    problems = []
    for field in ("hidden_size", "vocab_size"):
        drafted, actual = draft_config.get(field), text.get(field)
        if drafted is not None and actual is not None and drafted != actual:
            problems.append(f"{field}: the draft's is {drafted}, the target's {actual}")
    mtp_hidden = (draft_config.get("dmtp_config") or {}).get("mtp_hidden_size")
    if mtp_hidden is not None and text.get("hidden_size") is not None and mtp_hidden != text["hidden_size"]:
        problems.append(
            f"dmtp_config.mtp_hidden_size: the draft's is {mtp_hidden}, the target's hidden_size {text['hidden_size']}"
        )
    layers = text.get("num_hidden_layers")
    if layers is None:
        return problems
    if draft_config.get("num_target_layers") not in (None, layers):
        problems.append(
            f"num_target_layers: the draft's is {draft_config['num_target_layers']}, the target has {layers}"
        )
    # the layers whose outputs the draft reads (vLLM captures layer inputs: dflash ids + 1, and the DMTP export adds
    # the target's last layer, so the captured ids run up to num_hidden_layers)
    feature_layers = (draft_config.get("dflash_config") or {}).get("target_layer_ids") or []
    outside = [i for i in feature_layers if not 0 <= i < layers]
    if outside:
        problems.append(
            f"dflash_config.target_layer_ids {feature_layers}: {outside} outside the target's {layers} layers"
        )
    captured = draft_config.get("eagle_aux_hidden_state_layer_ids") or []
    outside = [i for i in captured if not 0 <= i <= layers]
    if outside:
        problems.append(f"eagle_aux_hidden_state_layer_ids {captured}: {outside} beyond the target's {layers} layers")
    return problems


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Raise `DraftFolderError` naming ``path`` unless it is a whole safetensors file: an 8-byte header length, a
    JSON header, and exactly as many data bytes as the header's largest ``data_offsets`` end (what a truncated or
    partly copied file gets wrong). Reads the header only."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DraftFolderError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length.")
        (header_length,) = struct.unpack("<Q", prefix)
        if 8 + header_length > size:
            raise DraftFolderError(
                f"{path} is truncated: its header says {header_length} header bytes, the file has {size} bytes "
                "in all. Copy or export it again."
            )
        try:
            header = json.loads(f.read(header_length))
            data_end = max(
                (int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError) as error:
            raise DraftFolderError(f"{path} has a safetensors header that cannot be parsed ({error}).") from error
    expected = 8 + header_length + data_end
    if size != expected:
        state = "truncated" if size < expected else "longer than its header describes"
        raise DraftFolderError(
            f"{path} is {state}: its header needs {expected} bytes, the file has {size}. Copy or export it again."
        )


def _check_weight_files(draft: Path) -> None:
    """Every safetensors file of the draft (and every shard its index names) exists and is whole."""
    files = sorted(draft.glob("*.safetensors"))
    index = draft / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as error:
            raise DraftFolderError(f"{index} cannot be read as a safetensors index ({error}).") from error
        missing = sorted(name for name in shards if not (draft / name).is_file())
        if missing:
            raise DraftFolderError(f"{index} names shards that {draft} does not hold: {missing}.")
    if not files:
        raise DraftFolderError(f"The draft folder {draft} holds no .safetensors weights.")
    for path in files:
        check_safetensors_file(path)


def check_draft(
    draft: str | os.PathLike, target: str | os.PathLike, target_config: Mapping[str, Any] | None = None
) -> None:
    """Raise `DraftFolderError`, saying what to do, unless the local folder ``draft`` is a draft vLLM can run for
    ``target``: not dmtp-hf's own format (``dmtp convert ... --to vllm`` or ``--to dflash`` first), hidden size,
    vocabulary and target layers matching the target's config (both named with the fields), and whole safetensors
    files (the broken one named).

    ``target_config`` is the target's ``config.json`` as a dict; by default it is read from the folder ``target``
    (when ``target`` is no local folder, such as a Hub id not yet downloaded, the draft is checked on its own).
    """
    draft, target_name = Path(draft), str(target)
    draft_config = _read_config(draft, "draft")
    _refuse_unconverted(draft, draft_config, target_name)
    if target_config is None and (Path(target) / "config.json").is_file():
        target_config = _read_config(Path(target), "target")
    if target_config is not None:
        _refuse_targets_without_captured_layers(target_config, target_name)
        problems = _field_mismatches(draft_config, target_config)
        if problems:
            raise DraftFolderError(
                f"The draft {draft} was not made for the target {target_name}:\n  "
                + "\n  ".join(problems)
                + f"\nUse a draft trained for {target_name} (or export this one with `dmtp convert ... --target` "
                "set to the target it was trained for, and serve that target)."
            )
    _check_weight_files(draft)
