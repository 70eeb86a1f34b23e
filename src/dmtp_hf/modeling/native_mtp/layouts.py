"""Where each target family keeps its native MTP head, and how it maps onto `NativeMTPHead`.

A family is one `MTPLayout` in a small registry keyed by ``model_type``. Adding a family is one
`register_mtp_layout` call: the checkpoint prefix of the MTP tensors, the names of the four MTP-specific tensors
(embedding norm, hidden norm, 2H->H projection, final norm), where the decoder block's tensors live, the concat
order, and any config change the one-layer block needs. The block itself, its norm class and its RoPE always come
from the target model (``type(decoder.layers[-1])``, ``type(decoder.norm)``, ``decoder.rotary_emb``), so a family
whose decoder layer already has the right tensor names needs no code at all.

Head-side module names (what the checkpoint names are mapped onto):

- ``embedding_norm``: norm of ``E(x_{t+1})``
- ``hidden_norm``: norm of the target hidden ``h_t``
- ``projection``: ``Linear(2H -> H, bias=False)`` over the concat
- ``layer``: the decoder block (attention + MLP/MoE with their own pre-norms)
- ``final_norm``: norm producing ``g_t``, the tensor fed to the target LM head
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedConfig

__all__ = [
    "MTPLayout",
    "UnsupportedMTPFamilyError",
    "build_mtp_layer_config",
    "get_mtp_layout",
    "register_mtp_layout",
    "registered_mtp_layouts",
    "resolve_mtp_layout",
]

# Module names of the MTP-specific parts of `NativeMTPHead` (the targets of `MTPLayout.tensor_names`).
HEAD_PARTS = ("embedding_norm", "hidden_norm", "projection", "final_norm")


class UnsupportedMTPFamilyError(ValueError):
    """The target's family has no registered native-MTP layout."""


@dataclass(frozen=True)
class MTPLayout:
    """How one target family stores its native MTP head in its checkpoint.

    Args:
        name: Registry key, usually the target ``model_type``.
        prefix: Checkpoint prefix of every MTP tensor; ``{num_hidden_layers}`` is replaced by the target's depth
            (DeepSeek-V3 stores its MTP layer as one extra decoder layer, ``model.layers.61.``).
        tensor_names: Checkpoint module names (relative to ``prefix``) of the MTP-specific parts, keyed by the
            head part they load into (one of ``embedding_norm``, ``hidden_norm``, ``projection``,
            ``final_norm``).
        block_prefix: Where the decoder block's tensors live relative to ``prefix`` (``"layers.0."`` for Qwen's
            ``mtp.layers.0.*``; ``""`` when they sit next to the MTP-specific tensors).
        ignored: Checkpoint module names (relative to ``prefix``) that duplicate tensors shared with the target
            (embedding, LM head copies); they are skipped.
        hidden_first: Concat order of the projection input: ``[N_h(h); N_e(E(x))]`` when True (MiMo-7B), else
            ``[N_e(E(x)); N_h(h)]``.
        num_layers_keys: Config attributes holding the number of MTP layers; the first one present wins. A value of
            0 means the target has no MTP head. When none is present, the checkpoint decides.
        config_overrides: Attributes set on the one-layer config of the block (on top of
            `build_mtp_layer_config`), e.g. to make sure Qwen3-Next's block is a sparse-MoE layer.
        architectures: Architecture names (``config.architectures``) that select this layout whatever the
            ``model_type`` says; MiMo-7B checkpoints are loaded as ``Qwen2ForCausalLM``.
        model_types: Further ``model_type`` values served by this layout (e.g. ``qwen3_5_text``, the config type of
            a Qwen3.5 checkpoint loaded with ``AutoModelForCausalLM``).
    """

    name: str
    prefix: str
    tensor_names: Mapping[str, str]
    block_prefix: str = ""
    ignored: tuple[str, ...] = ()
    hidden_first: bool = False
    num_layers_keys: tuple[str, ...] = ()
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.tensor_names) - set(HEAD_PARTS)
        missing = set(HEAD_PARTS) - set(self.tensor_names)
        if unknown or missing:
            raise ValueError(
                f"MTPLayout {self.name!r}: tensor_names must have exactly the keys {HEAD_PARTS} "
                f"(unknown: {sorted(unknown)}, missing: {sorted(missing)})"
            )

    def checkpoint_prefix(self, text_config: PreTrainedConfig) -> str:
        """The prefix of this target's MTP tensors in its checkpoint."""
        return self.prefix.format(num_hidden_layers=text_config.num_hidden_layers)

    def num_mtp_layers(self, text_config: PreTrainedConfig) -> int | None:
        """The number of MTP layers the config declares, or None when it does not say."""
        for key in self.num_layers_keys:
            value = getattr(text_config, key, None)
            if value is not None:
                return int(value)
        return None


_MTP_LAYOUTS: dict[str, MTPLayout] = {}


def register_mtp_layout(model_type: str, layout: MTPLayout, *, exist_ok: bool = False) -> None:
    """Register ``layout`` for targets whose config has ``model_type`` (and its ``model_types`` aliases)."""
    for key in (model_type, *layout.model_types):
        if key in _MTP_LAYOUTS and not exist_ok:
            raise ValueError(f"An MTP layout is already registered for model_type {key!r}")
        _MTP_LAYOUTS[key] = layout


def registered_mtp_layouts() -> dict[str, MTPLayout]:
    """A copy of the registry: ``model_type -> MTPLayout``."""
    return dict(_MTP_LAYOUTS)


def get_mtp_layout(model_type: str) -> MTPLayout:
    """The layout registered for ``model_type``; raises `UnsupportedMTPFamilyError` when there is none."""
    try:
        return _MTP_LAYOUTS[model_type]
    except KeyError:
        raise UnsupportedMTPFamilyError(
            f"No native MTP layout is registered for model_type {model_type!r}. Supported model types: "
            f"{sorted(_MTP_LAYOUTS)}. Add one with `register_mtp_layout`."
        ) from None


def resolve_mtp_layout(*configs: PreTrainedConfig | Mapping[str, Any] | None) -> MTPLayout:
    """Pick the layout for a target from its config(s).

    ``configs`` are tried in order (typically the in-memory target config, then the checkpoint's ``config.json``
    as a dict). Architecture aliases win over ``model_type`` (a MiMo-7B checkpoint loaded as ``Qwen2ForCausalLM``
    reports ``model_type="qwen2"`` but keeps ``architectures=["MiMoForCausalLM"]``).
    """
    configs = [c for c in configs if c is not None]

    def get(config, key):
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    for config in configs:  # a standalone head checkpoint (`save_mtp_head`) names its layout
        named = (get(config, "dmtp_mtp_head") or {}).get("layout")
        if named is not None:
            return get_mtp_layout(named)
    by_architecture = {arch: layout for layout in _MTP_LAYOUTS.values() for arch in layout.architectures}
    for config in configs:
        for architecture in get(config, "architectures") or ():
            if architecture in by_architecture:
                return by_architecture[architecture]
    model_types = [get(config, "model_type") for config in configs]
    for model_type in model_types:
        if model_type in _MTP_LAYOUTS:
            return _MTP_LAYOUTS[model_type]
    raise UnsupportedMTPFamilyError(
        f"No native MTP layout is registered for model_type {model_types[0] if model_types else None!r}. "
        f"Supported model types: {sorted(_MTP_LAYOUTS)}. Add one with `register_mtp_layout`."
    )


def build_mtp_layer_config(text_config: PreTrainedConfig, layout: MTPLayout) -> PreTrainedConfig:
    """The config of the head's one decoder layer: a deep copy of the target text config, one full-attention layer.

    Mirrors what Transformers' ``PreTrainedConfig.get_mtp_config`` changes: per-layer lists are replaced so that
    ``DecoderLayer(config, layer_idx=0)`` builds a full-attention layer (never a linear-attention/GDN one) with
    the MoE MLP the family uses for its MTP layer (``first_k_dense_replace = 0``), and ``num_hidden_layers = 1``
    (so that a cache built from this config has exactly one layer).
    """
    config = copy.deepcopy(text_config)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(getattr(config, "mtp_layer_types", None) or ["full_attention"])
    if getattr(config, "mlp_layer_types", None) is not None:
        mtp_mlp_layer_types = getattr(config, "mtp_mlp_layer_types", None)
        if mtp_mlp_layer_types is None:
            raise ValueError(
                f"{type(config).__name__} has `mlp_layer_types` but no `mtp_mlp_layer_types`: the MLP type of the "
                "MTP layer is ambiguous; set it with `MTPLayout.config_overrides`."
            )
        config.mlp_layer_types = list(mtp_mlp_layer_types)
    config.num_hidden_layers = 1
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    for key, value in layout.config_overrides.items():
        setattr(config, key, copy.deepcopy(value))
    if getattr(config, "layer_types", None) is not None and config.layer_types[0] != "full_attention":
        raise ValueError(f"The MTP layer must be a full-attention layer, got layer type {config.layer_types[0]!r}")
    return config


# ----------------------------------------------------------------------------------------------------------------
# Built-in families

_QWEN_MTP_NAMES = {
    "embedding_norm": "pre_fc_norm_embedding",
    "hidden_norm": "pre_fc_norm_hidden",
    "projection": "fc",
    "final_norm": "norm",
}
_DEEPSEEK_MTP_NAMES = {
    "embedding_norm": "enorm",
    "hidden_norm": "hnorm",
    "projection": "eh_proj",
    "final_norm": "shared_head.norm",
}

# Qwen3.5 / Qwen3.6, dense and MoE. The multimodal checkpoints keep the trunk under `model.language_model.*` but
# the MTP head at top-level `mtp.*`; loaded with `AutoModelForCausalLM` the config type is `qwen3_5(_moe)_text`.
register_mtp_layout(
    "qwen3_5",
    MTPLayout(
        name="qwen3_5",
        prefix="mtp.",
        tensor_names=_QWEN_MTP_NAMES,
        block_prefix="layers.0.",
        num_layers_keys=("mtp_num_hidden_layers",),
        model_types=("qwen3_5_text",),
    ),
)
register_mtp_layout(
    "qwen3_5_moe",
    MTPLayout(
        name="qwen3_5_moe",
        prefix="mtp.",
        tensor_names=_QWEN_MTP_NAMES,
        block_prefix="layers.0.",
        num_layers_keys=("mtp_num_hidden_layers",),
        model_types=("qwen3_5_moe_text",),
    ),
)
# Qwen3-Next: the MTP layer is a sparse-MoE layer whatever `mlp_only_layers` says about the trunk.
register_mtp_layout(
    "qwen3_next",
    MTPLayout(
        name="qwen3_next",
        prefix="mtp.",
        tensor_names=_QWEN_MTP_NAMES,
        block_prefix="layers.0.",
        num_layers_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
        config_overrides={"mlp_only_layers": [], "decoder_sparse_step": 1},
    ),
)
# DeepSeek-V3/R1 and GLM-4.5/4.6/4.7: one extra decoder layer `model.layers.{num_hidden_layers}.*` carrying
# copies of the embedding and LM head (ignored: the target's own are used).
for _model_type in ("deepseek_v3", "glm4_moe"):
    register_mtp_layout(
        _model_type,
        MTPLayout(
            name=_model_type,
            prefix="model.layers.{num_hidden_layers}.",
            tensor_names=_DEEPSEEK_MTP_NAMES,
            ignored=("embed_tokens", "shared_head.head"),
            num_layers_keys=("num_nextn_predict_layers", "num_mtp_layers"),
        ),
    )
# Xiaomi MiMo-7B: Qwen2 trunk (load it as `Qwen2ForCausalLM`), MTP at `model.mtp_layers.0.*`, hidden-first concat.
register_mtp_layout(
    "mimo",
    MTPLayout(
        name="mimo",
        prefix="model.mtp_layers.0.",
        tensor_names={
            "embedding_norm": "token_layernorm",
            "hidden_norm": "hidden_layernorm",
            "projection": "input_proj",
            "final_norm": "final_layernorm",
        },
        hidden_first=True,
        num_layers_keys=("num_nextn_predict_layers",),
        architectures=("MiMoForCausalLM",),
    ),
)
# Retrofitted heads: a new MTP head trained for a target that ships none (any decoder-only family, e.g. Llama),
# stored standalone (`export.save_mtp_head`) under Qwen-style names. Selected by the head checkpoint's config.
register_mtp_layout(
    "retrofit",
    MTPLayout(name="retrofit", prefix="mtp.", tensor_names=_QWEN_MTP_NAMES, block_prefix="layers.0."),
)
