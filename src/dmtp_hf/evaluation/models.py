"""Loading what an evaluation compares: the target, its tokenizer, drafts, and the drafting strategies.

Every command takes ``--target PATH --draft PATH [--dflash-draft PATH]``; omitted paths come from the bundled
trained models (``dmtp_hf.bundled.default_paths()``) when that module exists, otherwise the command stops with an
error asking for the paths.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the engine load on use: the `dmtp` parser reads this module's defaults
    import torch

    from ..assistant.drafters.base import Drafter

MTP_STRATEGY = re.compile(r"^mtp(\d+)(?:@(?P<head>[\w.-]+))?$")
DMTP_KINDS = ("dmtp", "dflash")
# dmtp:auto, mtp4:2, dmtp:auto-draft: the round width of a label (auto-draft: "auto" without prompt lookup)
WIDTH_SUFFIX = re.compile(r"^(?P<base>.+?):(?P<width>auto-draft|auto|\d+)$")
# What runs when `--strategies` is omitted ("dflash" only where a DFlash draft is known), followed by the labels of
# the `--extra-draft` options given; a bundle's other drafts run when named.
DEFAULT_STRATEGIES = ("dmtp", "dflash", "mtp4")


def default_strategies_text() -> str:
    """What the ``--strategies`` help says the default is (from :data:`DEFAULT_STRATEGIES`)."""
    named = ", ".join(f"{s} (when a DFlash draft is known)" if s == "dflash" else s for s in DEFAULT_STRATEGIES)
    return f"{named}, then the --extra-draft labels given"


def split_width(label: str) -> tuple[str, int | str | None]:
    """``"dmtp:auto"`` -> ``("dmtp", "auto")``, ``"mtp4:2"`` -> ``("mtp4", 2)``, ``"dflash"`` -> ``("dflash", None)``
    (the label and its round width; ``"dmtp:auto-draft"`` is ``"auto"`` too, its prompt lookup off:
    `lookup_of`)."""
    match = WIDTH_SUFFIX.match(label)
    if match is None:
        return label, None
    width = match["width"]
    return match["base"], "auto" if width.startswith("auto") else int(width)


def lookup_of(label: str) -> bool | None:
    """Whether a label's rounds let prompt lookup compete (``False`` for ``:auto-draft``; ``None``: the default)."""
    match = WIDTH_SUFFIX.match(label)
    return False if match is not None and match["width"] == "auto-draft" else None


@dataclass
class ModelPaths:
    """Checkpoint locations of one evaluation (``None`` where neither given nor bundled)."""

    target: str | None = None
    draft: str | None = None
    dflash_draft: str | None = None
    tokenizer: str | None = None
    extra_drafts: dict[str, str] = field(default_factory=dict)  # label -> DMTP/DFlash checkpoint[@head label]
    mtp_head: str | None = None  # head checkpoint replacing the target's own MTP head (tuned or retrofitted)
    heads: dict[str, str] = field(default_factory=dict)  # label -> further head checkpoints (mtpK@label)


def _bundled_defaults(bundle: str = "bundled") -> tuple[Mapping[str, Any] | None, str]:
    """``(paths, why)``: the bundle's models (``dmtp_hf.bundled.bundle_paths``) as `ModelPaths` fields, or
    ``(None, reason)`` while they do not exist."""
    from ..bundled import bundle_paths

    try:
        return bundle_paths(bundle), ""
    except (OSError, KeyError, ImportError) as err:  # NotBuiltError is a FileNotFoundError
        return None, str(err).splitlines()[0] if str(err) else type(err).__name__


def resolve_model_paths(
    target: str | Path | None,
    draft: str | Path | None,
    dflash_draft: str | Path | None = None,
    *,
    tokenizer: str | Path | None = None,
    extra_drafts: Mapping[str, str] | None = None,
    mtp_head: str | Path | None = None,
    heads: Mapping[str, str] | None = None,
    bundle: str = "bundled",
) -> ModelPaths:
    """Fill omitted paths from the bundle's models; raise ``ValueError`` asking for ``--target`` if none, and
    ``FileNotFoundError`` for a given folder that can only be local and is missing (before any Hub call)."""
    _require_local_folders(
        {"--target": target, "--tokenizer": tokenizer, "--mtp-head": mtp_head, **_labelled("--head", heads)},
        drafts={"--draft": draft, "--dflash-draft": dflash_draft, **_labelled("--extra-draft", extra_drafts)},
    )
    paths = ModelPaths(
        target=str(target) if target else None,
        draft=str(draft) if draft else None,
        dflash_draft=str(dflash_draft) if dflash_draft else None,
        tokenizer=str(tokenizer) if tokenizer else None,
        extra_drafts=dict(extra_drafts or {}),
        mtp_head=str(mtp_head) if mtp_head else None,
        heads=dict(heads or {}),
    )
    if paths.target is None or paths.draft is None:
        defaults, why = _bundled_defaults(bundle)
        if defaults is None and paths.target is None:
            raise ValueError(f"no bundled models ({why}); pass --target PATH --draft PATH [--dflash-draft PATH]")
        if defaults is not None and paths.target is None:
            # The bundled drafts were trained against the bundled target: take them together.
            paths.target = str(defaults["target"])
            paths.draft = paths.draft or _optional(defaults.get("draft"))
            paths.dflash_draft = paths.dflash_draft or _optional(defaults.get("dflash_draft"))
            paths.mtp_head = paths.mtp_head or _optional(defaults.get("mtp_head"))
            for label, path in (defaults.get("extra_drafts") or {}).items():
                paths.extra_drafts.setdefault(label, str(path))
            for label, path in (defaults.get("heads") or {}).items():
                paths.heads.setdefault(label, str(path))
    return paths


def _labelled(option: str, paths: Mapping[str, str] | None) -> dict[str, str]:
    return {f"{option} {label}": path for label, path in (paths or {}).items()}


def _require_local_folders(checkpoints: Mapping[str, Any], drafts: Mapping[str, Any]) -> None:
    """`require_local_folder` on every checkpoint an evaluation was given (option -> path); a draft given as
    ``PATH@HEAD`` is checked at its ``PATH``."""
    from ..local_paths import require_local_folder

    for option, path in checkpoints.items():
        require_local_folder(path, option)
    for option, spec in drafts.items():
        require_local_folder(str(spec).partition("@")[0] if spec else None, option)


def _optional(value: Any) -> str | None:
    return str(value) if value else None


def resolve_device_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """``device`` default: CUDA when available; ``dtype`` default: bfloat16 on CUDA, float32 on CPU."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype in (None, "auto"):
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(dtypes)}")
    return dev, dtypes[dtype]


def load_tokenizer(path: str):
    """The target tokenizer (``AutoTokenizer``), with a pad token (EOS) if it has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(target, tokenizer) -> list[int]:
    """Every token that ends a turn: the target's generation-config EOS ids plus the tokenizer's."""
    ids: list[int] = []
    configured = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    for value in (configured, getattr(tokenizer, "eos_token_id", None)):
        for token in value if isinstance(value, list | tuple) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


@dataclass
class Strategy:
    """One drafting strategy of a comparison: a label, its kind and the drafter that implements it."""

    label: str
    kind: str  # "dmtp", "dflash" or "mtp"
    drafter: Drafter
    checkpoint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    verify_length: int | str | None = None  # the label's own round width (``dmtp:auto``); None: the run's setting

    @property
    def prompt_lookup(self) -> bool | None:
        """Whether prompt lookup competes in its ``auto`` rounds (``False`` for ``:auto-draft``)."""
        return lookup_of(self.label)

    @property
    def num_candidates(self) -> int:
        """Candidates proposed per round."""
        return self.drafter.num_candidates

    def describe(self) -> dict[str, Any]:
        """JSON-friendly description."""
        return {
            "label": self.label,
            "kind": self.kind,
            "num_candidates": self.num_candidates,
            "checkpoint": self.checkpoint,
            **self.details,
        }


def parse_strategies(spec: str | None, paths: ModelPaths, extra_labels: Iterable[str] | None = None) -> list[str]:
    """Strategy labels from ``--strategies``. ``None``: :data:`DEFAULT_STRATEGIES` (``dflash`` when a DFlash draft is
    known), then ``extra_labels`` (the ``--extra-draft`` labels given; ``None``: every label of
    ``paths.extra_drafts``, a bundle's included).

    Valid labels: ``dmtp``, ``dflash``, ``mtpK`` (K >= 1; ``mtpK@HEAD`` with a head given by ``--head HEAD=PATH``)
    and the labels of ``--extra-draft LABEL=PATH``; each may end with ``:auto`` or ``:N``, its candidates verified
    per round (``dmtp,dmtp:auto`` compares a fixed and an adaptive width side by side).
    """
    if spec is None:
        labels = [s for s in DEFAULT_STRATEGIES if s != "dflash" or paths.dflash_draft]
        extras = paths.extra_drafts if extra_labels is None else extra_labels
        labels += [label for label in extras if label not in labels]
        return labels
    labels = [part.strip() for part in spec.split(",") if part.strip()]
    if not labels:
        raise ValueError("--strategies is empty")
    for label in (split_width(label)[0] for label in labels):
        if label not in DMTP_KINDS and not MTP_STRATEGY.match(label) and label not in paths.extra_drafts:
            raise ValueError(
                f"unknown strategy {label!r}: use dmtp, dflash, mtp1..mtpK or a label given with --extra-draft"
            )
        match = MTP_STRATEGY.match(label)
        if match and int(match.group(1)) < 1:
            raise ValueError(f"strategy {label!r}: MTP needs at least one step")
        if match and match["head"] and match["head"] not in paths.heads:
            raise ValueError(f"strategy {label!r}: no head {match['head']!r} (give it with --head LABEL=PATH)")
    if len(set(labels)) != len(labels):
        raise ValueError(f"--strategies repeats a label: {spec}")
    return labels


def build_strategies(labels: list[str], target, paths: ModelPaths, fast_path: bool = False) -> list[Strategy]:
    """Load the drafts the labels need (bound to ``target``) and build one :class:`Strategy` per label.

    All strategies share the target's native MTP head (loaded once from the target checkpoint, or from
    ``paths.mtp_head``); ``mtpK@LABEL`` and drafts given as ``PATH@LABEL`` use the head ``paths.heads[LABEL]``. Runs
    are sequential and every request re-initialises the drafter state, so sharing is safe. ``fast_path`` builds the
    fixed-slot drafters (CUDA graphs on GPU; same tokens).
    """
    from ..assistant.generate import as_drafter
    from ..modeling import DMTPDraftModel, load_native_mtp
    from ..modeling.native_mtp.loading import MissingMTPTensorsError

    device = next(target.parameters()).device
    dtype = target.get_input_embeddings().weight.dtype
    heads: dict[str | None, Any] = {}

    def native_mtp(label: str | None = None):
        if label not in heads:
            checkpoint = paths.mtp_head if label is None else paths.heads[label]
            try:
                heads[label] = load_native_mtp(target, checkpoint=checkpoint)
            except MissingMTPTensorsError as err:  # a RuntimeError upstream; an expected user-facing failure here
                raise ValueError(str(err)) from None
        return heads[label]

    def load_draft(spec: str, **overrides: Any) -> DMTPDraftModel:
        path, _, head = spec.partition("@")
        draft = DMTPDraftModel.from_pretrained(path, **overrides).to(device=device, dtype=dtype).eval()
        return draft.bind(
            target, native_mtp=native_mtp(head or None) if draft.config.anchor_layout != "dflash" else None
        )

    strategies = []
    for name in labels:
        label, width = split_width(name)
        match = MTP_STRATEGY.match(label)
        if match:
            steps = int(match.group(1))
            drafter = as_drafter(native_mtp(match["head"]), mtp_steps=steps, fast_path=fast_path)
            details = {
                "mtp_steps": steps,
                "mtp_head": paths.heads.get(match["head"], paths.mtp_head),
                "fast_path": fast_path,
                "verify_length": width,
            }
            strategies.append(Strategy(name, "mtp", drafter, None, details, width))
            continue
        if label == "dmtp":
            path = paths.draft
            if path is None:
                raise ValueError("strategy 'dmtp' needs a DMTP draft: pass --draft PATH (or drop it from --strategies)")
            draft = load_draft(path)
            if draft.config.anchor_layout == "dflash":
                raise ValueError(f"--draft {path} has anchor_layout='dflash'; pass it as --dflash-draft instead")
        elif label == "dflash":
            path = paths.dflash_draft
            if path is None:
                raise ValueError(
                    "strategy 'dflash' needs a DFlash draft: pass --dflash-draft PATH (or drop it from --strategies)"
                )
            draft = load_draft(path, anchor_layout="dflash")
        else:
            path = paths.extra_drafts[label]
            draft = load_draft(path)
        kind = "dflash" if draft.config.anchor_layout == "dflash" else "dmtp"
        drafter = as_drafter(draft, strategy=kind, fast_path=fast_path)
        cfg = draft.config
        details = {
            "anchor_layout": cfg.anchor_layout,
            "fusion": None if kind == "dflash" else cfg.fusion,
            "backbone": cfg.backbone,
            "fast_path": fast_path,
            "verify_length": width,
        }
        strategies.append(Strategy(name, kind, drafter, path, details, width))
    return strategies
