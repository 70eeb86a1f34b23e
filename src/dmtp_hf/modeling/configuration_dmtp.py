"""Configuration of the DMTP draft model.

A DMTP draft is a DFlash draft (Qwen3-style decoder layers reading the target's hidden states as extra K/V)
plus a small fusion module that injects the native MTP head's first candidate T1 and the MTP hidden state
that predicted it. The config therefore is a Qwen3 config with two nested sections:

* ``dflash_config``: exactly the keys DFlash checkpoints carry (``mask_token_id``, ``target_layer_ids``,
  optionally ``block_size``/``num_target_layers`` and engine extras, which are preserved verbatim);
* ``dmtp_config``: ``anchor_layout``, ``fusion``, ``num_candidates``, ``fusion_rank``, ``mtp_hidden_size``,
  ``mtp_hidden_input``, provenance (``target_model_type``, ``mtp_source``) and, once ``dmtp calibrate`` ran,
  ``acceptance_calibration`` (what ``verify_length="auto"`` predicts acceptance from).

Unmodified DFlash ``config.json`` files (``model_type: qwen3``, ``architectures: ["DFlashDraftModel"]``,
``block_size`` at the top level or inside ``dflash_config``) load through :meth:`DMTPConfig.from_dict`, and so do
z-lab DFlash2 ones (``architectures: ["DFlash2DraftModel"]``): the same config plus the ``dflash_config`` keys of
the grouped dynamic convolutions and the candidate selector (``backbone == "dflash2"``). Such a checkpoint loads
as the draft it is (``anchor_layout="dflash"``, ``block_size - 1`` candidates); pass ``anchor_layout="dual"``
(and ``num_candidates``) to start a DMTP draft from its weights.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..choices import ANCHOR_LAYOUTS, FUSIONS
from .validation import (
    check_acceptance_calibration,
    check_bool,
    check_choice,
    check_key_spelling,
    check_mask_token_id,
    check_number,
    check_positive_float,
    check_positive_int,
    check_target_layer_ids,
    require_mask_token_id,
)

# Blessed combinations (docs/design.md §1); other single/dual combinations are allowed as ablations.
DEFAULT_ANCHOR_LAYOUT = "dual"
DEFAULT_FUSION = "residual"
DEFAULT_NUM_CANDIDATES = 7
MTP_HIDDEN_INPUTS = ("post_norm", "pre_norm")

BACKBONES = ("dflash", "dflash2")
_DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# DFlash2's `dflash_config` keys and the defaults of a DFlash2 built here (z-lab's and SpecForge's published ones).
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# Upper bounds of sizes that nothing in the checkpoint pins, so that a broken field is refused at load instead of
# allocating terabytes in the first `generate` (or while building the model). A block is drafted in one pass and
# verified in one target forward: published drafts use 16 slots, and acceptance falls with the depth, so a block of
# more than 256 slots is a broken field, not a design. No published model has a layer wider than 2**17 or a
# vocabulary above 2**22 tokens (the largest are about 54k and 262k).
MAX_BLOCK_SIZE = 256
MAX_WIDTH = 1 << 17
MAX_VOCAB_SIZE = 1 << 22
MAX_LAYERS = 1024
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)
# What each section of a config reads: an unknown key close to one of these is a misspelling (`check_key_spelling`).
_DMTP_FIELDS = (
    "anchor_layout",
    "fusion",
    "num_candidates",
    "fusion_rank",
    "mtp_hidden_size",
    "mtp_hidden_input",
    "target_model_type",
    "mtp_source",
    "acceptance_calibration",
)
_DFLASH_FIELDS = ("mask_token_id", "target_layer_ids", "block_size", "num_target_layers", *DFLASH2_DEFAULTS)
# Read from `dflash_config` when present (engine extras written by some converters).
_DFLASH_EXTRAS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
_TOP_LEVEL_FIELDS = (
    *_DMTP_FIELDS[:6],
    "backbone",
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "num_target_layers",
    "draft_vocab_size",
    "dflash_config",
    "dmtp_config",
    "is_causal",
)
# Generic PreTrainedConfig keys that DFlash checkpoints do not carry.
_HF_GENERIC_KEYS = (
    "_name_or_path",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default DFlash feature layers: evenly spaced between layer 1 and ``L - 3`` (the z-lab/SpecForge rule)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _known_top_level_key(key: str) -> bool:
    """A key `DMTPConfig` reads, or one Transformers or a tokenizer legitimately writes (``*_token_id``)."""
    return key in _config_attributes() or key.endswith("_token_id")


@functools.cache
def _config_attributes() -> frozenset[str]:
    fields = {field.name for field in dataclasses.fields(DMTPConfig)}
    arguments = set(inspect.signature(DMTPConfig.__post_init__).parameters) - {"self", "kwargs"}
    return frozenset(fields | arguments | {name for name in dir(DMTPConfig) if not name.startswith("__")})


def check_config_keys(keys, where: str = "config key") -> None:
    """Refuse a top-level key (of ``config.json``, or a keyword override) that misspells a DMTP/DFlash field."""
    check_key_spelling(keys, _TOP_LEVEL_FIELDS, _known_top_level_key, where)


def require_config_file(path: str | os.PathLike, subfolder: str = "") -> None:
    """Raise ``FileNotFoundError`` for a local folder without ``config.json``, saying what a draft folder holds.

    Without this, Transformers reads such a folder as an empty config, which fails on the first missing size field.
    """
    folder = Path(os.path.expanduser(os.fspath(path))) / (subfolder or "")
    if not folder.is_dir() or (folder / "config.json").is_file():
        return
    found = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    inside = sorted(str(p.parent.relative_to(folder)) for p in folder.glob("*/config.json"))
    raise FileNotFoundError(
        f"No config.json in {folder}: a DMTP or DFlash draft folder holds config.json (the draft's size, "
        "dflash_config, dmtp_config) next to model.safetensors (or model-*.safetensors shards and "
        "model.safetensors.index.json). "
        + (
            f"This folder holds {', '.join(found[:10])}{', ...' if len(found) > 10 else ''}."
            if found
            else "It is empty."
        )
        + (f" Did you mean {', '.join(str(folder / name) for name in inside)}?" if inside else "")
    )


def require_local_directory(path: str | os.PathLike) -> None:
    """Raise ``FileNotFoundError`` for a path that is clearly local (not a Hub ``namespace/name`` id) but missing.

    Without this, Transformers reports a missing local folder as an invalid Hub repo id.
    """
    text = os.fspath(path)
    looks_local = isinstance(path, os.PathLike) or text.startswith((".", "/", "~")) or text.count("/") >= 2
    if looks_local and not os.path.isdir(os.path.expanduser(text)):
        raise FileNotFoundError(f"No checkpoint directory at {text!r}.")


def is_dflash_config_dict(config_dict: dict[str, Any]) -> bool:
    """True for a config written in the DFlash (z-lab / SpecForge) layout rather than by DMTP."""
    if "dmtp_config" in config_dict:
        return False
    archs = config_dict.get("architectures") or []
    return any(a in _DFLASH_ARCHITECTURES for a in archs) or "dflash_config" in config_dict


@functools.cache
def _floating_dtype_names() -> tuple[str, ...]:
    """``"float32"``, ``"bfloat16"``, ... : the names ``config.json`` may give ``dtype``."""
    dtypes = {name: getattr(torch, name) for name in dir(torch)}
    return tuple(name for name, dtype in dtypes.items() if isinstance(dtype, torch.dtype) and dtype.is_floating_point)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1  # JSON `true` is a Python int


@strict
class DMTPConfig(Qwen3Config):
    r"""Configuration of a [`DMTPDraftModel`]: the DFlash backbone plus the first-candidate fusion.

    Backbone fields are those of [`~transformers.Qwen3Config`] (hidden size, layers, heads, RoPE, sliding
    window, ...). DFlash and DMTP fields live in two nested dictionaries and are exposed as properties:

    - ``mask_token_id`` / ``target_layer_ids`` (``dflash_config``): the target embedding row used for MASK slots
      and the 0-based target layers whose outputs (``hidden_states[i + 1]``) form the context features.
    - ``anchor_layout``: ``"dflash"`` (``[A, MASK x 7]``), ``"single"`` (``[T1, MASK x 6]``) or ``"dual"``
      (``[A, T1, MASK x 6]``).
    - ``fusion``: how the MTP hidden reaches T1's slot: ``"none"``, ``"hidden_residual"`` (low-rank),
      ``"residual"`` (zero-initialised ``W[RMS(E(T1)); RMS(h)]`` added to ``E(T1)``) or ``"replace"``.
    - ``num_candidates``: draft tokens proposed per round (T1..T7 by default, i.e. 7).
    - ``draft_vocab_size``: the draft predicts over this many target tokens only (EAGLE-3's ``d2t``/``t2d``
      buffers in the checkpoint; ``None``: the whole vocabulary). The target still verifies over all of it.

    Example:

    ```python
    >>> from dmtp_hf import DMTPConfig
    >>> config = DMTPConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...                     head_dim=16, intermediate_size=128, vocab_size=128, num_target_layers=4,
    ...                     mask_token_id=127, target_layer_ids=[0, 2])
    >>> config.anchor_layout, config.fusion, config.block_length
    ('dual', 'residual', 8)
    ```
    """

    model_type = "dmtp"

    block_size: int = 16
    num_target_layers: int | None = None
    is_causal: bool | None = None
    dflash_config: dict | None = None
    dmtp_config: dict | None = None
    draft_vocab_size: int | None = None

    def __post_init__(
        self,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        anchor_layout: str | None = None,
        fusion: str | None = None,
        num_candidates: int | None = None,
        fusion_rank: int | None = None,
        mtp_hidden_size: int | None = None,
        mtp_hidden_input: str | None = None,
        backbone: str | None = None,
        **kwargs,
    ):
        check_config_keys(kwargs)  # what no field took: kept as an attribute, read by nothing
        self.dflash_config = copy.deepcopy(self.dflash_config) if self.dflash_config else {}
        self.dmtp_config = copy.deepcopy(self.dmtp_config) if self.dmtp_config else {}
        # Newer DFlash checkpoints nest block_size / num_target_layers in dflash_config.
        # Taken as written (no `int(...)`): "16", 2.5 or true must reach the checks of `validate_dmtp`.
        if "block_size" in self.dflash_config:
            self.block_size = self.dflash_config.pop("block_size")
        if "num_target_layers" in self.dflash_config and self.num_target_layers is None:
            self.num_target_layers = self.dflash_config.pop("num_target_layers")
        # Qwen3Config drops the window when `use_sliding_window` is false: check the value as written first.
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        if isinstance(self.dtype, str):  # Transformers reads it as `getattr(torch, dtype)`: "banana" is AttributeError
            check_choice("dtype", self.dtype, _floating_dtype_names(), " (a floating-point torch dtype)")
        super().__post_init__(**kwargs)

        explicit = {
            "mask_token_id": mask_token_id,
            "target_layer_ids": target_layer_ids,
        }
        for key, value in explicit.items():
            if value is not None:
                self.dflash_config[key] = value
        if self.dflash_config.get("target_layer_ids") is None and self.num_target_layers is not None:
            self.dflash_config["target_layer_ids"] = build_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )
        dmtp_explicit = {
            "anchor_layout": anchor_layout,
            "fusion": fusion,
            "num_candidates": num_candidates,
            "fusion_rank": fusion_rank,
            "mtp_hidden_size": mtp_hidden_size,
            "mtp_hidden_input": mtp_hidden_input,
        }
        for key, value in dmtp_explicit.items():
            if value is not None:
                self.dmtp_config[key] = value
        self.dmtp_config.setdefault("anchor_layout", DEFAULT_ANCHOR_LAYOUT)
        self.dmtp_config.setdefault(
            "fusion", "none" if self.dmtp_config["anchor_layout"] == "dflash" else DEFAULT_FUSION
        )
        self.dmtp_config.setdefault("num_candidates", DEFAULT_NUM_CANDIDATES)
        self.dmtp_config.setdefault("fusion_rank", 64)
        self.dmtp_config.setdefault("mtp_hidden_size", self.hidden_size)
        self.dmtp_config.setdefault("mtp_hidden_input", "post_norm")
        if backbone is not None:
            self.backbone = backbone
        self.validate_dmtp()

    # ----------------------------------------------------------------------------------------------------------
    # Validation

    def validate_dmtp(self) -> None:
        """Raise ``ValueError`` with a precise message for any DFlash/DMTP/backbone field that is of the wrong type,
        out of its range or inconsistent with another."""
        check_key_spelling(self.dmtp_config, _DMTP_FIELDS, _DMTP_FIELDS.__contains__, "dmtp_config key")
        known_dflash = (*_DFLASH_FIELDS, *_DFLASH_EXTRAS)
        check_key_spelling(self.dflash_config, _DFLASH_FIELDS, known_dflash.__contains__, "dflash_config key")
        self._validate_backbone_fields()
        self._validate_block()
        layout, fusion = self.anchor_layout, self.fusion
        if layout not in ANCHOR_LAYOUTS:
            raise ValueError(f"Unknown anchor_layout {layout!r}; expected one of {ANCHOR_LAYOUTS}.")
        if fusion not in FUSIONS:
            raise ValueError(f"Unknown fusion {fusion!r}; expected one of {FUSIONS}.")
        if layout == "dflash" and fusion != "none":
            raise ValueError(f"anchor_layout='dflash' has no T1 slot, so fusion must be 'none' (got {fusion!r}).")
        if self.mtp_hidden_input not in MTP_HIDDEN_INPUTS:
            raise ValueError(
                f"Unknown mtp_hidden_input {self.mtp_hidden_input!r}; expected one of {MTP_HIDDEN_INPUTS}."
            )
        why = f" (a block holds at most {MAX_BLOCK_SIZE} slots)"
        check_positive_int("num_candidates", self.num_candidates, MAX_BLOCK_SIZE - 1, why)
        for name in ("fusion_rank", "mtp_hidden_size"):
            check_positive_int(name, self.dmtp_config.get(name), MAX_WIDTH)
        if layout != "dflash" and self.num_candidates < 2:
            raise ValueError(f"anchor_layout={layout!r} needs num_candidates >= 2 (T1 from MTP + DFlash slots).")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        check_mask_token_id(self.mask_token_id, self.vocab_size)
        check_positive_float("rms_norm_eps", self.rms_norm_eps)
        check_acceptance_calibration(self.dmtp_config.get("acceptance_calibration"))
        if self.draft_vocab_size is not None:
            check_positive_int(
                "draft_vocab_size", self.draft_vocab_size, self.vocab_size, " (a subset of the vocabulary: vocab_size)"
            )
        if self.backbone == "dflash2":
            self._validate_dflash2()

    def _validate_backbone_fields(self) -> None:
        """The Qwen3 fields the draft's layers are built from, and the DFlash extras, against their meaning.

        Strict typing (Transformers' ``@strict``) already refuses a string for an integer field; these add the
        ranges (``0`` heads, a negative window or RoPE base), the bounds of sizes that would allocate absurd memory,
        the fields of this class (``is_causal``, ``num_target_layers``) and the names Transformers would only fail
        on when the model is built (an activation, a RoPE type, a dtype)."""
        check_positive_int("vocab_size", self.vocab_size, MAX_VOCAB_SIZE)
        for name in ("hidden_size", "intermediate_size", "head_dim"):
            check_positive_int(name, getattr(self, name), MAX_WIDTH)
        check_positive_int("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)
        check_positive_int("num_attention_heads", self.num_attention_heads, MAX_WIDTH // self.head_dim)
        check_positive_int("num_key_value_heads", self.num_key_value_heads, self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads} (each K/V head serves a whole group of query heads)."
            )
        check_positive_int("max_position_embeddings", self.max_position_embeddings)
        check_positive_int("max_window_layers", self.max_window_layers, minimum=0)
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        if self.num_target_layers is not None:
            check_positive_int("num_target_layers", self.num_target_layers, MAX_LAYERS)
        check_bool("is_causal", self.is_causal, optional=True)
        check_choice("hidden_act", self.hidden_act, ACT2FN, " (the activations of transformers' ACT2FN)")
        check_number("initializer_range", self.initializer_range, 0)
        check_number("attention_dropout", self.attention_dropout, 0, 1, high_open=True)
        self._validate_rope()
        for name in ("input_embedding_scale", "output_multiplier"):
            if self.dflash_config.get(name) is not None:
                check_number(f"dflash_config.{name}", self.dflash_config[name], 0, low_open=True)
        if self.dflash_config.get("final_logit_softcapping") is not None:  # 0: no softcapping, as in Gemma configs
            check_number("dflash_config.final_logit_softcapping", self.dflash_config["final_logit_softcapping"], 0)

    def _validate_rope(self) -> None:
        """``rope_parameters`` (one dict, or one per layer type): a known ``rope_type`` and a positive base."""
        parameters = self.rope_parameters or {}
        nested = parameters and all(isinstance(value, dict) or value is None for value in parameters.values())
        for where, rope in parameters.items() if nested else [("", parameters)]:
            if not rope:
                continue
            prefix = f"rope_parameters[{where!r}]." if where else ""
            check_choice(f"{prefix}rope_type", rope.get("rope_type", "default"), ROPE_TYPES)
            if "rope_theta" in rope:
                check_number(f"{prefix}rope_theta", rope["rope_theta"], 0, low_open=True)

    def _validate_block(self) -> None:
        """``block_size``: the slots of a drafting block (the anchor and ``block_size - 1`` candidates), bounded by
        ``MAX_BLOCK_SIZE`` and by the positions the draft has (``max_position_embeddings``)."""
        limit = min(MAX_BLOCK_SIZE, self.max_position_embeddings)
        why = f" (min({MAX_BLOCK_SIZE}, max_position_embeddings): a round drafts block_size - 1 tokens at once)"
        check_positive_int("block_size", self.block_size, limit, why, minimum=2)  # the anchor and one candidate

    def _validate_dflash2(self) -> None:
        values = {key: self.dflash_config.get(key) for key in DFLASH2_DEFAULTS}
        bad = [f"{key}={value!r}" for key, value in values.items() if not _is_positive_int(value)]
        if bad:
            raise ValueError(f"DFlash2 needs positive integers for {', '.join(bad)} (dflash_config).")
        if self.hidden_size % values["conv_group_size"]:
            raise ValueError(
                f"conv_group_size={values['conv_group_size']} does not divide hidden_size={self.hidden_size}."
            )
        block = f" (taps past the block's {self.block_length} slots read only padding)"
        check_positive_int("dflash_config.conv_kernel_size", values["conv_kernel_size"], self.block_length, block)
        check_positive_int("dflash_config.selector_rank", values["selector_rank"], MAX_WIDTH)
        vocabulary = self.draft_vocab_size or self.vocab_size  # the walk picks among the draft's top-k logits
        if values["selector_top_k"] > vocabulary:
            raise ValueError(
                f"selector_top_k={values['selector_top_k']} exceeds the draft's vocabulary ({vocabulary} tokens: "
                "draft_vocab_size, else vocab_size)."
            )

    # ----------------------------------------------------------------------------------------------------------
    # Nested fields as attributes (settable, so `from_pretrained(path, anchor_layout="dflash")` works)

    @property
    def mask_token_id(self) -> int | None:
        """Target embedding row used for the MASK slots."""
        return self.dflash_config.get("mask_token_id")

    @mask_token_id.setter
    def mask_token_id(self, value: int) -> None:
        self.dflash_config["mask_token_id"] = value

    @property
    def target_layer_ids(self) -> list[int] | None:
        """0-based target layers whose outputs (``hidden_states[i + 1]``) are the context features."""
        return self.dflash_config.get("target_layer_ids")

    @target_layer_ids.setter
    def target_layer_ids(self, value: list[int]) -> None:
        self.dflash_config["target_layer_ids"] = list(value)

    def _dmtp_property(name: str, doc: str):  # noqa: N805 - class-body helper
        def getter(self):
            return self.dmtp_config.get(name)

        def setter(self, value):
            self.dmtp_config[name] = value
            if name == "anchor_layout" and value == "dflash":
                self.dmtp_config["fusion"] = "none"
            self.validate_dmtp()

        return property(getter, setter, doc=doc)

    anchor_layout = _dmtp_property("anchor_layout", "Block layout: 'dflash', 'single' or 'dual'.")
    fusion = _dmtp_property("fusion", "T1 fusion: 'none', 'hidden_residual', 'residual' or 'replace'.")
    num_candidates = _dmtp_property("num_candidates", "Draft tokens proposed per round (default 7).")
    fusion_rank = _dmtp_property("fusion_rank", "Rank of the low-rank 'hidden_residual' fusion.")
    mtp_hidden_size = _dmtp_property("mtp_hidden_size", "Width of the MTP hidden state fed to the fusion.")
    mtp_hidden_input = _dmtp_property(
        "mtp_hidden_input", "Which target hidden the MTP head reads: 'post_norm' (default) or 'pre_norm'."
    )
    del _dmtp_property

    @property
    def backbone(self) -> str:
        """``"dflash2"`` when the grouped dynamic convolutions and the candidate selector are in (their keys in
        ``dflash_config``), else ``"dflash"``. Setting ``"dflash2"`` fills missing keys with ``DFLASH2_DEFAULTS``."""
        return "dflash2" if "conv_kernel_size" in self.dflash_config else "dflash"

    @backbone.setter
    def backbone(self, value: str) -> None:
        if value not in BACKBONES:
            raise ValueError(f"Unknown backbone {value!r}; expected one of {BACKBONES}.")
        if value == "dflash2":
            for key, default in DFLASH2_DEFAULTS.items():
                self.dflash_config.setdefault(key, default)
        else:
            for key in DFLASH2_DEFAULTS:
                self.dflash_config.pop(key, None)
        self.validate_dmtp()

    @property
    def num_context_features(self) -> int:
        """Number of target layers concatenated into the context features (``fc`` input = this x hidden)."""
        return len(self.target_layer_ids or [])

    @property
    def block_length(self) -> int:
        """Slots per drafting block at inference: 8 for every layout with 7 candidates except ``single`` (7)."""
        n = self.num_candidates
        return {"dflash": n + 1, "single": n, "dual": n + 1}[self.anchor_layout]

    @property
    def block_offset(self) -> int:
        """Position of the block's first slot relative to A (the last emitted token)."""
        return 1 if self.anchor_layout == "single" else 0

    @property
    def first_predicted_slot(self) -> int:
        """Index of the first slot whose output is a draft proposal (MASK slots only)."""
        return {"dflash": 1, "single": 1, "dual": 2}[self.anchor_layout]

    # ----------------------------------------------------------------------------------------------------------
    # DFlash compatibility

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> DMTPConfig:
        """Build from a DMTP or an unmodified DFlash ``config.json`` dictionary."""
        config_dict = dict(config_dict)
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if key not in config_dict]
        if missing:  # Qwen3's defaults (a 32-layer model) would load a different draft, or fail confusingly later
            raise ValueError(f"The draft config is missing {missing}: a DFlash/DMTP config.json states its size.")
        if is_dflash_config_dict(config_dict):
            config_dict["_loaded_from_dflash"] = True
            # A DFlash/DFlash2 checkpoint decodes as what it is, with the block it was trained with; DMTP on its
            # weights (zero-init fusion) is an explicit `anchor_layout="dual"`.
            block = (config_dict.get("dflash_config") or {}).get(
                "block_size", config_dict.get("block_size", cls.block_size)
            )
            config_dict["dmtp_config"] = {"anchor_layout": kwargs.get("anchor_layout") or "dflash"}
            if not kwargs.get("num_candidates") and isinstance(block, int) and block >= 2:
                config_dict["dmtp_config"]["num_candidates"] = block - 1
        # What the checkpoint's own fusion was, before any override: a checkpoint saved without fusion weights
        # (DFlash, or a DMTP checkpoint with layout 'dflash' / fusion 'none') may be loaded into a fusion layout.
        saved = (config_dict.get("dmtp_config") or {}).get("fusion")
        saved_layout = (config_dict.get("dmtp_config") or {}).get("anchor_layout")
        if config_dict.get("_loaded_from_dflash") or saved == "none" or saved_layout == "dflash":
            config_dict["_checkpoint_without_fusion"] = True
        # The checkpoint's own backbone, before any override (a DFlash checkpoint may start a DFlash2 draft).
        nested = config_dict.get("dflash_config") or {}
        config_dict["_checkpoint_backbone"] = "dflash2" if "conv_kernel_size" in nested else "dflash"
        config_dict.pop("model_type", None)
        if config_dict.get("_loaded_from_dflash"):
            config_dict.pop("auto_map", None)  # a DFlash repo's remote code is DFlash's, not this draft's
        config_dict["architectures"] = ["DMTPDraftModel"]
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> DMTPConfig:
        """Load a DMTP or DFlash ``config.json`` (local folder or Hub repo) without the model-type warning.

        A field of the wrong type or value, a misspelt field (``"num_candidate"``: did you mean ``num_candidates``?)
        or a missing ``dflash_config.mask_token_id`` raises ``ValueError`` prefixed with the file (``.../config.json:
        ...``); a misspelt keyword override raises ``ValueError`` too. A folder without ``config.json``, or a path
        that is neither a folder nor a readable Hub repo, raises ``FileNotFoundError``."""
        require_local_directory(pretrained_model_name_or_path)
        path = os.fspath(pretrained_model_name_or_path)
        if not path.endswith(".json"):
            require_config_file(path, kwargs.get("subfolder") or "")
        where = path if path.endswith(".json") else os.path.join(path, kwargs.get("subfolder") or "", "config.json")
        try:
            config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        except OSError as err:
            if os.path.exists(os.path.expanduser(path)):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise FileNotFoundError(
                f"No checkpoint directory at {path!r}, and no Hub repo of that name could be read ({first})."
            ) from err
        wants_unused = kwargs.pop("return_unused_kwargs", False)
        try:
            config, unused = cls.from_dict(config_dict, return_unused_kwargs=True, **kwargs)
            config.validate_dmtp()  # again: keyword overrides were set after construction
            require_mask_token_id(config)
        except (ValueError, StrictDataclassError) as err:  # a wrong field names its file: the caller loaded a folder
            raise ValueError(f"{where}: {' '.join(str(err).split())}") from err  # strict's errors span lines
        check_config_keys(unused, "keyword argument")  # no field took it: the override would be dropped
        return (config, unused) if wants_unused else config

    @property
    def checkpoint_without_fusion(self) -> bool:
        """True when the loaded checkpoint carried no fusion weights (DFlash, or a DMTP 'dflash'/'none' draft)."""
        return bool(getattr(self, "_checkpoint_without_fusion", False))

    @property
    def checkpoint_without_dflash2(self) -> bool:
        """True when a DFlash2 draft is loaded from a checkpoint that has no DFlash2 tensors (plain DFlash)."""
        return self.backbone == "dflash2" and getattr(self, "_checkpoint_backbone", "dflash2") == "dflash"

    @property
    def loaded_from_dflash(self) -> bool:
        """True when this config was read from a DFlash checkpoint (no fusion weights to expect)."""
        return bool(getattr(self, "_loaded_from_dflash", False))

    def to_dflash_dict(self) -> dict[str, Any]:
        """The config as a DFlash ``config.json`` (``model_type: qwen3``), as z-lab and SpecForge write it."""
        out = self.to_dict()
        for key in (
            "dmtp_config",
            "_loaded_from_dflash",
            "_checkpoint_without_fusion",
            "_checkpoint_backbone",
            "transformers_version",
            "auto_map",
            *_HF_GENERIC_KEYS,
        ):
            out.pop(key, None)
        if out.get("is_causal") is None:
            out.pop("is_causal", None)
        out["model_type"] = "qwen3"
        out["architectures"] = ["DFlash2DraftModel" if self.backbone == "dflash2" else "DFlashDraftModel"]
        dflash = dict(out.get("dflash_config") or {})
        # block_size at the top level and in dflash_config: some converters read only one of them.
        dflash["block_size"] = self.block_size
        out["dflash_config"] = dflash
        out["block_size"] = self.block_size
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        return out

    def to_dict(self) -> dict[str, Any]:
        """Serialise, dropping the private loading marker."""
        out = super().to_dict()
        out.pop("_loaded_from_dflash", None)
        out.pop("_checkpoint_without_fusion", None)
        out.pop("_checkpoint_backbone", None)
        return out


__all__ = [
    "ANCHOR_LAYOUTS",
    "BACKBONES",
    "DFLASH2_DEFAULTS",
    "FUSIONS",
    "DMTPConfig",
    "build_target_layer_ids",
    "check_config_keys",
    "is_dflash_config_dict",
    "require_config_file",
]
