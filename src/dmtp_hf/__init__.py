"""dmtp-hf: DMTP speculative decoding for Hugging Face Transformers.

The target's native MTP head proposes the first draft token T1 of each round; a DFlash-style parallel drafter
proposes T2..T7 in one forward pass, conditioned on T1 and on the MTP hidden state that predicted it.

```python
target = AutoModelForCausalLM.from_pretrained(target_path)
dmtp = DMTPDraftModel.from_pretrained(draft_path, target=target)   # binds the native MTP head
out = target.generate(**inputs, assistant_model=dmtp, max_new_tokens=256)
```

The public names load on first use (PEP 562), so ``import dmtp_hf`` and the ``dmtp`` command's ``--help`` load
neither torch nor Transformers. Loading any of them imports :mod:`dmtp_hf.modeling`, which registers the draft with
``AutoConfig``/``AutoModel``; binding a draft to a target routes that target's ``generate(assistant_model=...)``
into the engine (``modeling.binding``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

# Public name -> the subpackage that defines it.
_LAZY = {
    **dict.fromkeys(
        (
            "DFlashDrafter",
            "DMTPCandidateGenerator",
            "DMTPDrafter",
            "DMTPGenerateOutput",
            "MTPDrafter",
            "SpecStats",
            "dmtp_custom_generate",
            "generate",
            "generate_with_transformers_loop",
            "install_generate_router",
            "route_bound_targets",
            "speculative_decode",
        ),
        "assistant",
    ),
    **dict.fromkeys(
        (
            "DMTPConfig",
            "DMTPDraftModel",
            "MissingMTPTensorsError",
            "NativeMTPHead",
            "NoNativeMTPError",
            "UnsupportedMTPFamilyError",
            "load_native_mtp",
        ),
        "modeling",
    ),
}
_SUBPACKAGES = ("assistant", "bundled", "cli", "demo", "evaluation", "modeling", "training")

if TYPE_CHECKING:
    from .assistant import (
        DFlashDrafter,
        DMTPCandidateGenerator,
        DMTPDrafter,
        DMTPGenerateOutput,
        MTPDrafter,
        SpecStats,
        dmtp_custom_generate,
        generate,
        generate_with_transformers_loop,
        install_generate_router,
        speculative_decode,
    )
    from .assistant import route_bound_targets as route_bound_targets
    from .modeling import (
        DMTPConfig,
        DMTPDraftModel,
        MissingMTPTensorsError,
        NativeMTPHead,
        NoNativeMTPError,
        UnsupportedMTPFamilyError,
        load_native_mtp,
    )


def __getattr__(name: str) -> Any:
    """Import the subpackage that defines ``name`` on first access (and keep the value here)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBPACKAGES:  # `import dmtp_hf; dmtp_hf.modeling.X` worked while they loaded eagerly
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own names and the lazily loaded public ones."""
    return sorted({*globals(), *_LAZY, *_SUBPACKAGES})


__all__ = [
    "DFlashDrafter",
    "DMTPCandidateGenerator",
    "DMTPConfig",
    "DMTPDraftModel",
    "DMTPDrafter",
    "DMTPGenerateOutput",
    "MTPDrafter",
    "MissingMTPTensorsError",
    "NativeMTPHead",
    "NoNativeMTPError",
    "SpecStats",
    "UnsupportedMTPFamilyError",
    "__version__",
    "dmtp_custom_generate",
    "generate",
    "generate_with_transformers_loop",
    "install_generate_router",
    "load_native_mtp",
    "speculative_decode",
]
