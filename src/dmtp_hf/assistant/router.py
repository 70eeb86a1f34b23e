"""Routing ``target.generate(**inputs, assistant_model=dmtp)`` into the DMTP engine.

Stock Transformers has no extension point for this: ``generate`` refuses ``assistant_model`` with a stateful
(hybrid linear-attention) target before any hook runs, and its assisted loop drives only its own candidate
generators. So binding a draft to its target (``DMTPDraftModel.from_pretrained(path, target=target)`` or
``draft.bind(target)``) puts a thin router on *that target instance's* ``generate``: when ``assistant_model`` is a
DMTP draft, a native MTP head or any :class:`Drafter`, the call goes to Transformers' ``custom_generate`` hook
with :func:`~dmtp_hf.assistant.generate.dmtp_custom_generate`; every other call goes to the original ``generate``
untouched. No class and no other instance is changed.

The router is a bind hook of ``DMTPDraftModel`` by default: ``modeling.binding`` names
:func:`install_generate_router` by its dotted path (``DEFAULT_BIND_HOOKS``) and imports this module at the first
bind, so the modeling layer never imports the engine and ``from dmtp_hf import DMTPDraftModel`` alone is enough.
Call :func:`install_generate_router` yourself for a target you drive with a bare :class:`Drafter`.
"""

from __future__ import annotations

import types

from ..modeling.binding import register_bind_hook
from .generate import ROUTER_ORIGINAL, as_drafter, engine_kwargs

__all__ = ["install_generate_router", "route_bound_targets"]


def install_generate_router(target) -> None:
    """Make ``target.generate(..., assistant_model=<DMTP draft, MTP head or Drafter>)`` run DMTP decoding.

    Idempotent; only this instance's ``generate`` is wrapped. ``dmtp_fast_path=True`` selects fixed-slot drafters.
    """
    if getattr(target, ROUTER_ORIGINAL, None) is not None:
        return
    original = target.generate

    def routed_generate(self, *args, assistant_model=None, streamer=None, dmtp_fast_path=False, **kwargs):
        drafter = as_drafter(assistant_model, fast_path=dmtp_fast_path)
        if drafter is None:
            return original(*args, assistant_model=assistant_model, streamer=streamer, **kwargs)
        return original(*args, **engine_kwargs(self, drafter, streamer, kwargs))

    setattr(target, ROUTER_ORIGINAL, original)
    target.generate = types.MethodType(routed_generate, target)


def route_bound_targets() -> None:
    """Install the router on every target a draft is bound to from now on. Binding already does by default
    (``modeling.binding.DEFAULT_BIND_HOOKS``); kept for code that calls it, it registers the same hook once."""
    register_bind_hook(install_generate_router)
