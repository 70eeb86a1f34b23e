"""Binding a draft (or an MTP head) to its target: compatibility checks, shared references, bind hooks.

A draft owns no embedding, no LM head and no MTP head: it uses its target's. :func:`bind_draft` checks that the
target can host the draft, attaches the target and the native MTP head as plain references (never submodules: they
are neither saved nor moved with the draft, and ``references.deepcopy_sharing`` keeps them out of copies), and runs the
bind hooks. The first is the generation layer's router (``dmtp_hf.assistant.router.install_generate_router``, which
routes ``target.generate(assistant_model=draft)`` into the engine): it is named here by its dotted path and imported
at the first bind, so this layer never imports the engine, and a user who imported only ``DMTPDraftModel`` gets a
routed target all the same. :func:`register_bind_hook` adds more.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

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
    "register_bind_hook",
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
