"""The ``custom_generate`` entry of a pushed DMTP repo (``custom_generate/generate.py``, generated from this module).

``target.generate(**inputs, custom_generate=REPO, trust_remote_code=True, assistant_model=draft)`` loads the repo's
``custom_generate/generate.py`` and calls its ``generate(model=target, ...)`` with every argument ``generate`` got,
``assistant_model`` and ``tokenizer`` included, before Transformers' own mode checks (which refuse assisted decoding
on hybrid targets). This function binds the draft to the target if needed (the native MTP head is read from the
target's own checkpoint) and runs the engine through the ``custom_generate`` callable hook, so generation config,
processors, stopping criteria and outputs keep their Transformers meaning. Without a DMTP draft it is plain
``generate``.
"""

from __future__ import annotations

from typing import Any

from transformers.generation.utils import GenerationMixin

from .generate import as_drafter, engine_kwargs

__all__ = ["generate"]


def generate(model, *args: Any, assistant_model: Any = None, streamer=None, dmtp_fast_path: bool = False, **kwargs):
    """Speculative ``generate`` for ``model`` with a DMTP/DFlash draft (or a native MTP head) as ``assistant_model``."""
    target = getattr(assistant_model, "_target", None)
    if target is not model and hasattr(assistant_model, "bind"):
        assistant_model.bind(model)
    drafter = as_drafter(assistant_model, fast_path=dmtp_fast_path)
    if drafter is None:
        return GenerationMixin.generate(model, *args, assistant_model=assistant_model, streamer=streamer, **kwargs)
    return GenerationMixin.generate(model, *args, **engine_kwargs(model, drafter, streamer, kwargs))
