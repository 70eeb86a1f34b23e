"""Binding a draft (or an MTP head) to its target: compatibility checks, shared references, bind hooks.

A draft owns no embedding, no LM head and no MTP head: it uses its target's. :func:`bind_draft` checks that the
target can host the draft, attaches the target and the native MTP head as plain references (never submodules: they
are neither saved nor moved with the draft, and ``references.deepcopy_sharing`` keeps them out of copies), and runs the
bind hooks. The first is the generation layer's router (``dmtp_hf.assistant.router.install_generate_router``, which
routes ``target.generate(assistant_model=draft)`` into the engine): it is named here by its dotted path and imported
at the first bind, so this layer never imports the engine, and a user who imported only ``DMTPDraftModel`` gets a
routed target all the same. :func:`register_bind_hook` adds more.

A draft records the target it was trained for (:func:`target_identity`, written by the trainer); binding it to a
target with another identity warns. A draft that was never bound and is passed to ``generate`` anyway is refused
with the way to bind it (:data:`UNBOUND_ASSISTANT`, :func:`guard_unbound_assistants`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from .configuration_dmtp import DMTPConfig
from .native_mtp.layouts import UnsupportedMTPFamilyError
from .native_mtp.loading import NoNativeMTPError, load_native_mtp

__all__ = [
    "DEFAULT_BIND_HOOKS",
    "UNBOUND_ASSISTANT",
    "bind_draft",
    "bound_native_mtp",
    "check_draft_target_compatibility",
    "guard_unbound_assistants",
    "register_bind_hook",
    "target_identity",
]

UNBOUND_ASSISTANT = (
    "DMTPDraftModel is not a Transformers assistant model on its own: bind it to its target "
    "(DMTPDraftModel.from_pretrained(path, target=target) or draft.bind(target)); target.generate(..., "
    "assistant_model=draft) then runs DMTP decoding."
)

BindHook = Callable[[nn.Module], None]
# "module:function" of the router. Only in this package: the remote code of a pushed repo copies this file without
# the engine (its `custom_generate` routes there), and an installed dmtp_hf's router must not reach its targets.
DEFAULT_BIND_HOOKS = ("dmtp_hf.assistant.router:install_generate_router",) if __name__.startswith("dmtp_hf.") else ()
_BIND_HOOKS: list[BindHook | str] = list(DEFAULT_BIND_HOOKS)


def register_bind_hook(hook: BindHook | str) -> None:
    """Run ``hook(target)`` whenever a draft is bound to a target (idempotent per hook). ``hook`` is a callable, or
    the ``"module:function"`` path of one, imported at the first bind. The router of the generation layer is
    registered by default (:data:`DEFAULT_BIND_HOOKS`); the modeling layer itself knows nothing of decoding."""
    if hook not in _BIND_HOOKS:
        _BIND_HOOKS.append(hook)


def _bind_hooks() -> list[BindHook]:
    """The registered hooks, paths imported, each function once (a path and the function it names run once)."""
    hooks: list[BindHook] = []
    for index, hook in enumerate(_BIND_HOOKS):
        if isinstance(hook, str):
            module, _, name = hook.partition(":")
            hook = _BIND_HOOKS[index] = getattr(importlib.import_module(module), name)
        if hook not in hooks:
            hooks.append(hook)
    return hooks


def _text_config(target: nn.Module):
    return target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config


def check_draft_target_compatibility(config: DMTPConfig, target: nn.Module) -> None:
    """Raise ``ValueError`` if ``target`` cannot host a draft with ``config`` (see :func:`bind_draft`)."""
    target_config, name = _text_config(target), type(target).__name__
    if target_config.hidden_size != config.hidden_size:
        raise ValueError(
            f"Draft hidden_size={config.hidden_size} does not match the target {name} "
            f"hidden_size={target_config.hidden_size}."
        )
    num_layers = target_config.num_hidden_layers
    ids = config.target_layer_ids or []
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {ids} out of range for the target {name} with {num_layers} layers (bad: {bad})."
        )
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        raise ValueError(
            f"The draft was built for a target with num_target_layers={config.num_target_layers}, but the "
            f"target {name} has {num_layers} layers."
        )
    rows = target.get_input_embeddings().weight.shape[0]
    if config.mask_token_id is None or not 0 <= config.mask_token_id < rows:
        raise ValueError(f"mask_token_id={config.mask_token_id} is outside the target embedding ({rows} rows).")
    head = target.get_output_embeddings()
    if head is not None and head.weight.shape[0] != config.vocab_size:
        raise ValueError(
            f"Vocabulary mismatch: the draft was built for vocab_size={config.vocab_size}, the target LM head "
            f"has {head.weight.shape[0]} rows."
        )


# The target config fields that make a draft's features and tokens mean what they meant in training: the family and
# its sizes, the vocabulary and the positions (a draft reads the target's hidden states, embeddings and LM head).
_IDENTITY_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "rope_parameters",
    "rope_theta",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "num_nextn_predict_layers",
    "mtp_num_hidden_layers",
)


def target_identity(target: nn.Module) -> dict[str, Any]:
    """What a trained draft records of its target (``dmtp_config["target_identity"]``): ``config_sha256``, a hash
    of the target config's architecture-defining fields (`_IDENTITY_FIELDS`, the vocabulary size included), plus
    the ``model_type`` and ``name_or_path`` the warning of a mismatched bind quotes. Cheap: it reads the config only."""
    text = _text_config(target)
    fields = {name: getattr(text, name, None) for name in _IDENTITY_FIELDS}
    canonical = json.dumps(fields, sort_keys=True, default=str)  # default=str: enums, dtypes in rope dicts
    return {
        "config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "model_type": text.model_type,
        "name_or_path": str(getattr(target.config, "_name_or_path", "") or ""),
    }


def warn_if_another_target(config: DMTPConfig, target: nn.Module) -> None:
    """Warn when the draft recorded the identity of the target it was trained for and ``target`` has another one.

    Sizes alone pass `check_draft_target_compatibility`: a draft trained for one target then binds to any other of
    the same sizes, and silently drafts tokens that target rarely accepts. Drafts without the record (trained before
    it existed, converted from DFlash) are not warned about."""
    recorded = (config.dmtp_config or {}).get("target_identity")
    if not isinstance(recorded, dict) or not recorded.get("config_sha256"):
        return
    current = target_identity(target)
    if recorded["config_sha256"] == current["config_sha256"]:
        return
    trained_for = recorded.get("name_or_path") or "another target"
    warnings.warn(
        f"This draft was trained for {trained_for} (model_type {recorded.get('model_type')!r}), and the target "
        f"{current['name_or_path'] or type(target).__name__} (model_type {current['model_type']!r}) has another "
        "architecture config (its fields differ from the recorded target's). It binds, since the sizes fit, but "
        "expect few accepted tokens: use the draft trained for this target, or train one.",
        UserWarning,
        stacklevel=4,
    )


def bind_draft(draft: nn.Module, target: nn.Module, native_mtp: nn.Module | None = None) -> None:
    """Attach ``target`` (and its native MTP head) to ``draft`` after checking compatibility.

    A draft with a T1 slot (layouts ``single``/``dual``) needs the MTP head: without ``native_mtp`` it is read from
    the target's own checkpoint now. A target that ships none (a retrofitted head, or the wrong family) leaves the
    head unbound, and the first use says which head to pass. A draft whose floating-point dtype differs from the
    target's is cast to the target's dtype: it consumes the target's embeddings and features and feeds its LM head.
    """
    config = draft.config
    if config.num_target_layers is None:  # older configs omit it: the bound target says, not the draft
        config.num_target_layers = _text_config(target).num_hidden_layers
    check_draft_target_compatibility(config, target)
    warn_if_another_target(config, target)
    target_dtype = target.get_input_embeddings().weight.dtype
    own = next((p.dtype for p in draft.parameters() if p.is_floating_point()), target_dtype)
    if target_dtype.is_floating_point and own != target_dtype:
        draft.to(dtype=target_dtype)
    missing_reason = None
    if native_mtp is None and config.anchor_layout != "dflash":
        try:
            native_mtp = load_native_mtp(target, hidden_input=config.mtp_hidden_input)
        except (NoNativeMTPError, UnsupportedMTPFamilyError, FileNotFoundError) as err:
            missing_reason = str(err)
    draft.__dict__["_target"] = target  # plain references on purpose: never saved, moved or copied
    draft.__dict__["_native_mtp"] = native_mtp
    draft.__dict__["_native_mtp_missing"] = missing_reason
    for hook in _bind_hooks():
        hook(target)


def bound_native_mtp(draft: nn.Module) -> nn.Module:
    """The native MTP head bound with the draft's target, or an error that says how to bind one."""
    head = draft.__dict__.get("_native_mtp")
    if head is None:
        reason = draft.__dict__.get("_native_mtp_missing")
        retrofit = draft.config.dmtp_config.get("mtp_source") == "retrofit"
        raise RuntimeError(
            (
                "This draft was trained with a retrofitted MTP head (its target ships none): "
                if retrofit
                else "This draft has no native MTP head bound: "
            )
            + "bind it with `draft.bind(target, native_mtp=load_native_mtp(target, checkpoint=HEAD_DIR))` "
            + "(eval/bench: --mtp-head HEAD_DIR)."
            + (f" Reading the target's own head failed: {reason}" if reason else "")
            + (
                " Without a head, load the draft with anchor_layout='dflash' to decode it as DFlash."
                if draft.config.anchor_layout != "dflash"
                else ""
            )
        )
    return head


def _is_unbound_draft(assistant: Any) -> bool:
    """A DMTP draft (this package's class or a Hub repo's copy of it) that was never bound to a target."""
    return (
        isinstance(assistant, nn.Module)
        and any(cls.__name__ == "DMTPDraftModel" for cls in type(assistant).__mro__)
        and assistant.__dict__.get("_target") is None
    )


def guard_unbound_assistants() -> None:
    """Make ``target.generate(assistant_model=draft)`` say "bind the draft" when the draft was never bound and the
    target is stateful (hybrid linear attention: Qwen3.5, Qwen3-Next).

    Binding routes that target's ``generate`` into the engine (`bind_draft`). Without it the call is Transformers'
    own, which refuses assisted decoding on a stateful target before it reads anything of the assistant ("assisted
    generation is not supported with stateful models"): true, but silent about the fix. The one Transformers method
    that sees both the target and the assistant first, ``GenerationMixin._validate_generation_mode``, is wrapped
    (once per process, by ``import dmtp_hf.modeling``) to raise :data:`UNBOUND_ASSISTANT` for exactly that case;
    every other call runs the original unchanged. (On other targets Transformers reads the assistant's
    ``generation_config``, where the draft raises the same message.)
    """
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.__dict__.get("_validate_generation_mode")
    if original is None or getattr(original, "_dmtp_unbound_guard", False):
        return

    @functools.wraps(original)
    def validate_generation_mode(self, *args: Any, **kwargs: Any):
        mode_kwargs = kwargs.get("generation_mode_kwargs", args[2] if len(args) > 2 else None) or {}
        if getattr(self, "_is_stateful", False) and _is_unbound_draft(mode_kwargs.get("assistant_model")):
            raise ValueError(UNBOUND_ASSISTANT)
        return original(self, *args, **kwargs)

    validate_generation_mode._dmtp_unbound_guard = True
    GenerationMixin._validate_generation_mode = validate_generation_mode
