"""Load-time checks of a draft checkpoint that would otherwise load although it is wrong.

Transformers loads what a checkpoint holds into the model it builds from ``config.json``, casting and dropping on the
way: an integer tensor is cast into a floating-point parameter (weights truncated without a word), tensors the model
ignores on purpose (a DFlash checkpoint's copies of the target's ``embed_tokens``/``lm_head``) vanish, and a config
field of the wrong type only fails later, far from the file, or not at all. These checks refuse such checkpoints at
load with a ``ValueError`` naming the file, the field or tensor and what was expected:

- config fields (called by ``DMTPConfig.validate_dmtp``): every field against its meaning: integers in their range
  (booleans and floats refused, sizes that would allocate absurd memory bounded), numbers in their interval, booleans,
  names from a fixed set (activations: those of Transformers' ``ACT2FN``), ``target_layer_ids``, ``mask_token_id``
  and ``dmtp_config.acceptance_calibration`` as ``dmtp calibrate`` writes it;
- tensors (called by ``DMTPDraftModel.from_pretrained``, from the safetensors headers): no integer or boolean
  storage for a floating-point parameter, and stored copies of the target's embedding / LM head equal to the bound
  target's (without a target at load, a warning names them).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers.utils import cached_file

__all__ = [
    "check_acceptance_calibration",
    "check_bool",
    "check_checkpoint_tensors",
    "check_choice",
    "check_key_spelling",
    "check_mask_token_id",
    "check_number",
    "check_positive_float",
    "check_positive_int",
    "check_target_layer_ids",
    "require_mask_token_id",
]

CALIBRATION = "dmtp_config.acceptance_calibration"
# What the draft ignores at load because it always uses its target's (`_keys_to_ignore_on_load_unexpected`).
_TARGET_COPIES = {r"(^|\.)embed_tokens\.weight$": "input embedding", r"(^|\.)lm_head\.weight$": "LM head"}
_CHUNK = 1 << 22  # elements compared at once: a 150k-row embedding is never copied whole to float32


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON `true` is a Python int


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


# ----------------------------------------------------------------------------------------------------------
# Config fields


def check_key_spelling(keys: Iterable[str], fields: Sequence[str], known: Callable[[str], bool], where: str) -> None:
    """Refuse a key that ``known`` rejects but that is close to one of ``fields``: a misspelt field.

    Transformers keeps any unknown ``config.json`` key as a plain attribute, which nothing reads: ``"num_candidate": 6``
    would load a draft with the default ``num_candidates``. Keys that resemble no field stay accepted (DFlash configs
    and engines add their own). ``where`` names the kind of key in the message (``"config key"``, ``"keyword
    argument"``, ``"dmtp_config key"``...).
    """
    for key in keys:
        if not isinstance(key, str) or known(key):
            continue
        match = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        if match:
            raise ValueError(
                f"Unknown {where} {key!r}: did you mean {match[0]!r}? (As written it would be ignored and "
                f"{match[0]} left at its default.)"
            )


def check_positive_int(name: str, value: Any, maximum: int | None = None, why: str = "", minimum: int = 1) -> None:
    """Refuse ``value`` unless it is an integer in ``minimum..maximum`` (booleans refused: ``true`` would read as 1;
    floats refused: ``2.5`` slots or layers mean nothing). ``maximum`` bounds a size that would otherwise allocate
    absurd memory, ``why`` says where the bound comes from (appended to the message)."""
    if not _is_int(value) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {_short(value)}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}{why}, got {value}.")


def check_number(
    name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Refuse ``value`` unless it is a finite number (not a boolean, not a string) in the interval from ``low`` to
    ``high``, each end excluded when ``low_open`` / ``high_open``."""
    if (
        _is_number(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    ):
        return
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"
    raise ValueError(f"{name} must be a finite number in {interval}, got {_short(value)}.")


def check_bool(name: str, value: Any, optional: bool = False) -> None:
    """Refuse ``value`` unless it is ``True`` or ``False`` (or ``None`` when ``optional``): a JSON string such as
    ``"yes"`` or ``"false"`` would read as true."""
    if isinstance(value, bool) or (optional and value is None):
        return
    expected = "true, false or null (unset)" if optional else "true or false"
    raise ValueError(f"{name} must be {expected}, got {_short(value)}.")


def check_choice(name: str, value: Any, choices: Iterable[Any], what: str = "") -> None:
    """Refuse ``value`` unless it is one of ``choices``; ``what`` names where the choices come from."""
    choices = sorted(choices, key=str)
    if value not in choices:
        raise ValueError(f"Unknown {name} {_short(value)}; expected one of {choices}{what}.")


def check_target_layer_ids(ids: Any, num_target_layers: int | None) -> None:
    """Refuse ``target_layer_ids`` unless a non-empty list of non-negative integers (booleans refused) below
    ``num_target_layers`` (when known)."""
    if ids is None:
        return
    if not isinstance(ids, list | tuple) or not ids or any(not _is_int(i) or i < 0 for i in ids):
        raise ValueError(f"target_layer_ids must be non-negative integers (not booleans), got {_short(ids)}.")
    if num_target_layers is not None and max(ids) >= num_target_layers:
        raise ValueError(f"target_layer_ids {ids} out of range for num_target_layers={num_target_layers}.")


def check_mask_token_id(mask_token_id: Any, vocab_size: int) -> None:
    """Refuse a set ``dflash_config.mask_token_id`` that is not an integer row of the ``vocab_size`` embedding."""
    if mask_token_id is not None and (not _is_int(mask_token_id) or not 0 <= mask_token_id < vocab_size):
        raise ValueError(
            f"dflash_config.mask_token_id must be an integer in [0, vocab_size={vocab_size}), got "
            f"{_short(mask_token_id)}."
        )


def require_mask_token_id(config: Any) -> None:
    """Refuse a loaded config without ``dflash_config.mask_token_id`` (it would only fail when bound)."""
    if config.mask_token_id is None:
        raise ValueError(
            "dflash_config.mask_token_id is missing: the draft needs the target embedding row its MASK slots use "
            "(a DFlash config.json states it in dflash_config; pass mask_token_id=... to set it)."
        )


def check_positive_float(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is a finite number > 0."""
    if not _is_number(value) or value <= 0:
        raise ValueError(f"{name} must be a positive float, got {_short(value)}.")


def _probabilities(value: Any) -> bool:
    return isinstance(value, list) and all(_is_number(v) and 0 <= v <= 1 for v in value)


def check_acceptance_calibration(value: Any) -> None:
    """Refuse a ``dmtp_config.acceptance_calibration`` that ``verify_length="auto"`` could not read.

    ``dmtp calibrate`` writes ``{"edges": [...], "rates": [[...], ...], "base_rates": [...]}`` (`widths.Calibration`):
    ``edges`` increasing bin edges in ``(0, 1]``, ``rates`` one list per candidate position of one probability per
    edge, ``base_rates`` (optional, older fits lack it) one probability per position. ``None`` or ``{}``: uncalibrated.
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(
            f"{CALIBRATION} must be a dict with 'edges', 'rates' and 'base_rates' (as `dmtp calibrate` writes it), "
            f"got {type(value).__name__} {_short(value)}."
        )
    if not value:
        return
    missing = [key for key in ("edges", "rates") if key not in value]
    if missing:
        raise ValueError(
            f"{CALIBRATION} is missing {missing} (`dmtp calibrate` writes 'edges', 'rates', 'base_rates')."
        )
    edges, rates = value["edges"], value["rates"]
    increasing = _probabilities(edges) and all(a < b for a, b in zip(edges, edges[1:]))
    if not increasing or any(e == 0 for e in edges) or (rates and not edges):
        raise ValueError(f"{CALIBRATION}.edges must be increasing numbers in (0, 1], got {_short(edges)}.")
    if not isinstance(rates, list) or any(not _probabilities(row) or len(row) != len(edges) for row in rates):
        raise ValueError(
            f"{CALIBRATION}.rates must be a list (one per candidate position) of {len(edges)} probabilities (one per "
            f"edge), got {_short(rates)}."
        )
    base = value.get("base_rates")
    if base is not None and not _probabilities(base):
        raise ValueError(f"{CALIBRATION}.base_rates must be a list of probabilities in [0, 1], got {_short(base)}.")


# ----------------------------------------------------------------------------------------------------------
# Tensors


def checkpoint_files(path: str | os.PathLike, kwargs: dict[str, Any]) -> list[str]:
    """The safetensors files ``from_pretrained(path, **kwargs)`` read: ``model.safetensors`` or the shards its index
    names (a local folder, or the Hub cache the load just filled). Empty for other formats or an in-memory state."""
    if kwargs.get("state_dict") is not None or kwargs.get("gguf_file"):
        return []
    keys = ("subfolder", "revision", "cache_dir", "token", "local_files_only", "proxies")
    options = {key: kwargs[key] for key in keys if kwargs.get(key) is not None}
    options.update(_raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    variant = kwargs.get("variant")
    name = f"model.{variant}.safetensors" if variant else "model.safetensors"
    single = cached_file(path, name, **options)
    if single:
        return [single]
    index = cached_file(path, f"{name}.index.json", **options)
    if not index:
        return []
    shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    return [file for file in (cached_file(path, shard, **options) for shard in shards) if file]


def _rename(name: str, key_mapping: dict[str, str]) -> str:
    for pattern, replacement in key_mapping.items():  # as Transformers applies `key_mapping`: the first match
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name


def _stored(files: list[str], key_mapping: dict[str, str]) -> dict[str, tuple[str, str, str]]:
    """Model name -> (stored name, safetensors dtype such as "F32" or "I32", file), from the headers only."""
    stored = {}
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                stored[_rename(name, key_mapping)] = (name, handle.get_slice(name).get_dtype(), file)
    return stored


def _check_stored_dtypes(model: nn.Module, stored: dict[str, tuple[str, str, str]]) -> None:
    own = model.state_dict()
    bad = [
        f"{file}: {name!r} is stored as {dtype}, expected a floating-point dtype ({own[key].dtype} in the model)"
        for key, (name, dtype, file) in stored.items()
        if key in own and own[key].is_floating_point() and not dtype.startswith(("F", "BF"))
    ]
    if bad:
        raise ValueError(
            f"{len(bad)} checkpoint tensor(s) hold integers or booleans where the draft has floating-point weights "
            f"(loading would cast them: the weights are truncated, not the trained ones): {bad[:20]}"
        )


def _target_copies(model: nn.Module, stored: dict[str, tuple[str, str, str]]) -> dict[str, tuple[str, str, str]]:
    """Stored name -> (what of the target it copies, file, model name) for the tensors the draft ignores."""
    # A draft vocabulary's `lm_head.weight` is the target head's subset rows (engines read it from the draft folder):
    # legitimately different from the target's whole head.
    subset = getattr(model, "d2t", None) is not None or "d2t" in stored
    own, copies = model.state_dict(), {}
    for key, (name, _, file) in stored.items():
        what = next((what for pattern, what in _TARGET_COPIES.items() if re.search(pattern, key)), None)
        if what is not None and key not in own and not (subset and what == "LM head"):
            copies[name] = (what, file, key)
    return copies


def _same_weights(stored: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal shapes and values within the tolerance of the coarser floating-point dtype of the two."""
    if stored.shape != theirs.shape:
        return False
    rtol = max(torch.finfo(t.dtype).eps if t.dtype.is_floating_point else 0.0 for t in (stored, theirs))
    flat_ours, flat_theirs = stored.reshape(-1), theirs.detach().reshape(-1)
    for start in range(0, flat_ours.numel(), _CHUNK):
        ours = flat_ours[start : start + _CHUNK].to(theirs.device, torch.float32)
        if not torch.allclose(ours, flat_theirs[start : start + _CHUNK].float(), rtol=rtol, atol=1e-5):
            return False
    return True


def _check_target_copies(copies: dict[str, tuple[str, str, str]], target: nn.Module) -> None:
    for name, (what, file, _) in copies.items():
        module = target.get_input_embeddings() if what == "input embedding" else target.get_output_embeddings()
        theirs = (module if module is not None else target.get_input_embeddings()).weight  # tied: the embedding
        if theirs.device.type == "meta":  # offloaded: nothing to compare against here
            continue
        with safe_open(file, "pt") as handle:
            ours = handle.get_tensor(name)
        if not _same_weights(ours, theirs):
            raise ValueError(
                f"{file}: {name!r} {tuple(ours.shape)} is not the target's {what} {tuple(theirs.shape)}: the draft "
                f"always uses the target's {what}, not these weights, so it was trained for another target (or the "
                "tensor is corrupt). Load it with the target it was trained for."
            )


def check_checkpoint_tensors(
    model: nn.Module, path: str | os.PathLike, kwargs: dict[str, Any], target: nn.Module | None = None
) -> None:
    """Refuse what ``from_pretrained(path, **kwargs)`` loaded silently although it is wrong (see the module docstring).

    Reads the safetensors headers of ``path`` (sharded or not; other formats are not checked): an integer or boolean
    tensor stored for a floating-point parameter raises ``ValueError`` naming the file, the tensor and its dtype.
    Stored ``embed_tokens.weight`` / ``lm_head.weight`` (ignored: the draft uses its target's) must equal ``target``'s
    input embedding / LM head within the coarser dtype's tolerance; without ``target`` a warning names them.
    """
    files = checkpoint_files(path, kwargs)
    if not files:
        return
    stored = _stored(files, kwargs.get("key_mapping") or {})
    _check_stored_dtypes(model, stored)
    copies = _target_copies(model, stored)
    if copies and target is not None:
        _check_target_copies(copies, target)
    elif copies:
        files = ", ".join(sorted({file for _, file, _ in copies.values()}))
        warnings.warn(
            f"{files}: the checkpoint carries {sorted(copies)}, which the draft ignores (it always uses its target's "
            "embedding and LM head). Load it with `target=` to check they are that target's.",
            stacklevel=3,
        )
