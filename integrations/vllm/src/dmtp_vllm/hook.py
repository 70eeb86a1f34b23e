"""The one place dmtp-vllm reaches into vLLM internals: which proposer the model runner builds.

vLLM chooses its drafter inside ``GPUModelRunner.__init__`` (the CPU runner inherits it) from a closed list of
methods, and ``SpeculativeConfig`` refuses method names it does not know. A DMTP draft therefore runs under
``"method": "dflash"`` (its folder is a DFlash folder plus the head and fusion), and this module swaps the
``DFlashProposer`` the runner built for a `DMTPProposer` when the draft's architecture is DMTP's. Nothing changes
for any other draft.

The swap depends on the runner's attribute names, so it is pinned to the vLLM versions it was written against:
`install` raises `UnsupportedVLLMVersion` on any other version rather than run a silently different round.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["SUPPORTED_VLLM", "UnsupportedVLLMVersion", "install", "is_dmtp_draft"]

SUPPORTED_VLLM = ("0.32.",)  # version prefixes whose runner this hook was read against


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range dmtp-vllm supports."""


def is_dmtp_draft(speculative_config: Any) -> bool:
    """Whether vLLM is speculating with a DMTP draft folder (``dmtp convert --to vllm``)."""
    from .model import ARCHITECTURE

    draft = getattr(speculative_config, "draft_model_config", None)
    return (
        speculative_config is not None
        and speculative_config.method == "dflash"
        and draft is not None
        and ARCHITECTURE in (getattr(draft.hf_config, "architectures", None) or [])
    )


def check_version(version: str) -> None:
    """Raise `UnsupportedVLLMVersion` unless ``version`` is one this hook was written against."""
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVLLMVersion(
            f"dmtp-vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is vLLM {version}. "
            "Install a supported vLLM (pip install 'dmtp-vllm[cpu]' or '[cuda]') or a dmtp-vllm made for yours."
        )


def install() -> None:
    """Wrap the model runner's constructor so that a DMTP draft gets a `DMTPProposer` (idempotent)."""
    import vllm
    from vllm.v1.worker import gpu_model_runner

    check_version(vllm.__version__)
    runner_class = gpu_model_runner.GPUModelRunner
    original = runner_class.__init__
    if getattr(original, "_dmtp_installed", False):
        return

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if is_dmtp_draft(self.speculative_config) and hasattr(self, "drafter"):
            from .proposer import DMTPProposer

            self.drafter = DMTPProposer(self.vllm_config, self.device, self)

    __init__._dmtp_installed = True  # type: ignore[attr-defined]
    runner_class.__init__ = __init__
