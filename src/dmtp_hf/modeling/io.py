"""Checkpoint files: atomic writes and the DFlash (z-lab / SpecForge) on-disk layout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


@contextlib.contextmanager
def atomic_directory(final_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``final_dir`` only once the block succeeds.

    An interrupted write leaves the previous ``final_dir`` (if any) intact and no half-written checkpoint.
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make a checkpoint unreadable to other users
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_json(path: str | os.PathLike, data: Any, **dump_kwargs: Any) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary sibling renamed over it: a reader (or an interrupted
    writer) never sees half a file. ``dump_kwargs`` go to `json.dump`. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".json")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, **dump_kwargs)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    return path


def check_loading_info(info: dict[str, Any]) -> None:
    """Strict loading: raise ``ValueError`` naming every missing, unexpected or mis-shaped tensor that the model's
    own ignore rules (applied by Transformers to ``info``) did not excuse."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(f"Checkpoint is missing {len(missing)} tensor(s) required by the DMTP config: {missing[:20]}")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        raise ValueError(
            f"Checkpoint has {len(unexpected)} tensor(s) this DMTP config does not use (wrong layout or an "
            f"unsupported DFlash variant such as DFlash2/Domino?): {unexpected[:20]}"
        )
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        details = [f"{k}: checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in mismatched]
        raise ValueError(f"Checkpoint tensor shapes do not match the DMTP config: {details}")


def check_finite(tensors, what: str) -> None:
    """Raise ``ValueError`` naming every floating-point tensor of ``tensors`` (``(name, tensor)`` pairs) that holds
    NaN or infinity: a corrupt checkpoint must not load silently (it would only show as a collapsed acceptance)."""
    bad = [name for name, tensor in tensors if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ValueError(f"{what} has non-finite values (NaN or inf) in {len(bad)} tensor(s): {bad[:20]}")


def backbone_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DFlash tensors of a DMTP draft's state dict (no ``fusion.*``, no rotary buffers), contiguous, detached."""
    return {
        name: tensor.detach().contiguous()
        for name, tensor in state_dict.items()
        if not name.startswith("fusion.") and "rotary_emb" not in name
    }


def save_dflash_checkpoint(
    state_dict: dict[str, torch.Tensor],
    config: dict[str, Any],
    save_directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``config.json`` + ``model.safetensors`` exactly in the DFlash layout (unprefixed keys).

    ``state_dict`` is a DMTP draft's (its fusion is dropped), ``config`` its ``config.to_dflash_dict()``.
    """
    state = backbone_state_dict(state_dict)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    config = dict(config)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    with atomic_directory(save_directory) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
