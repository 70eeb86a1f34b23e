"""The one place dmtp-vllm reaches into vLLM internals: which proposer the model runner builds, one CPU kernel, and
the moment the speculative config is built (to check the draft folder).

vLLM chooses its drafter inside ``GPUModelRunner.__init__`` (the CPU runner inherits it) from a closed list of
methods, and ``SpeculativeConfig`` refuses method names it does not know. A DMTP draft therefore runs under
``"method": "dflash"`` (its folder is a DFlash folder plus the head and fusion), and this module swaps the
``DFlashProposer`` the runner built for a `DMTPProposer` when the draft's architecture is DMTP's. Nothing changes
for any other draft.

It also gives vLLM's workers two methods, ``dmtp_policy_report`` (`report.policy_report`) and
``dmtp_proposal_log`` (`report.proposal_log`), so that ``llm.collective_rpc("dmtp_policy_report")`` reads what the
DMTP policy chose and ``collective_rpc("dmtp_proposal_log")`` what the draft proposed (``DMTP_VLLM_PROPOSAL_LOG=1``;
with it, vLLM's own drafters log their proposals too).

The CPU build's stand-in for the ``expand`` kernel of vLLM's rejection sampler (``cpu_triton_utils.
_expand_kernel_impl`` in vLLM 0.32) converts its output tensor to int64 and computes into that copy, so a float
output (per-token temperature, top-p) is never written and the sampler divides the logits by uninitialised memory:
every speculative method of vLLM's CPU build (its DFlash, n-gram and MTP as well as DMTP) samples from the wrong
distribution at temperature > 0, while greedy decoding (no temperature) is unaffected. `fix_cpu_expand_kernel` puts
a correct implementation in its place before the CPU platform registers its kernels.

And it checks the draft folder when vLLM builds its speculative config (``EngineArgs.create_speculative_config``,
before any weights load): `checks.check_draft` refuses a folder vLLM would otherwise fail on only after loading the
target (`check_drafts_before_loading`); for a DMTP folder it also makes the engine run the V1 model runner, whose
drafter the hook replaces (`require_v1_model_runner`: with Triton, vLLM would pick V2 and run the folder as DFlash).

All three depend on vLLM's attribute names, so it is pinned to the vLLM versions it was written against:
`install` raises `UnsupportedVLLMVersion` on any other version rather than run a silently different round.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

__all__ = [
    "SUPPORTED_VLLM",
    "UnsupportedVLLMVersion",
    "check_drafts_before_loading",
    "expand_batch_values",
    "fix_cpu_expand_kernel",
    "install",
    "is_dmtp_draft",
    "require_v1_model_runner",
]

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


def expand_batch_values(
    output: Any,  # [num_tokens]
    input_val: Any,  # [batch_size]
    cu_num_tokens: Any,  # [batch_size], cumulative tokens per request
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the kernel's launch-argument name)
) -> None:
    """Write request ``i``'s value (``replace_from`` read as ``replace_to``) into its tokens' slots of ``output``:
    what vLLM's ``expand_kernel`` does, for any dtype."""
    import torch

    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total).to(output.dtype))


def fix_cpu_expand_kernel() -> None:
    """Replace the CPU build's ``expand`` stand-in (module docstring) before the platform registers it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils

    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        raise UnsupportedVLLMVersion("vLLM's CPU kernels moved: dmtp-vllm cannot fix the rejection sampler's expand")
    cpu_triton_utils._expand_kernel_impl = expand_batch_values


def check_drafts_before_loading() -> None:
    """Wrap ``EngineArgs.create_speculative_config`` (idempotent) so that a local DFlash-method draft folder, or any
    folder in dmtp-hf's own format, passes `checks.check_draft` before vLLM builds the draft's config: the engine
    refuses a bad draft in seconds, saying what to do, instead of after loading the target."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_dmtp_installed", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self: Any, target_model_config: Any, *args: Any, **kwargs: Any) -> Any:
        spec = self.speculative_config or {}
        draft = spec.get("model")
        if draft and os.path.isdir(draft) and (spec.get("method") == "dflash" or _is_dmtp_hf_folder(draft)):
            from .checks import check_draft

            target_config = None
            if not os.path.isdir(target_model_config.model):  # a Hub id: the config vLLM already read
                target_config = target_model_config.hf_config.to_dict()
            check_draft(draft, target_model_config.model, target_config)
            from .model import ARCHITECTURE

            if _folder_architecture(draft) == ARCHITECTURE:
                require_v1_model_runner()
        return original(self, target_model_config, *args, **kwargs)

    create_speculative_config._dmtp_installed = True  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config


def require_v1_model_runner(environ: dict[str, str] | None = None) -> None:
    """Make the engine about to start run vLLM's V1 model runner, whose drafter the hook replaces by DMTP's.

    With Triton (any GPU build) vLLM 0.32 runs its V2 model runner by default, and there a DMTP folder would run as
    vLLM's own DFlash (the block without T1: lossless, but not DMTP) without a word. The engine's processes start
    after this, with this environment (``VLLM_USE_V2_MODEL_RUNNER=0``); asking for V2 explicitly is refused."""
    environ = os.environ if environ is None else environ
    asked = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if asked is not None and asked.strip() not in ("", "0"):
        raise RuntimeError(
            f"dmtp-vllm runs DMTP drafts on vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER={asked!r} asks for "
            "V2 (where the folder would run as plain DFlash, without T1): unset it, or serve a DFlash draft"
        )
    environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _folder_architecture(folder: str) -> str | None:
    """The first of ``architectures`` in ``folder``'s config.json (None when unreadable)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return (json.load(f).get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError, IndexError):
        return None


def _is_dmtp_hf_folder(folder: str) -> bool:
    """Whether ``folder`` holds a draft in dmtp-hf's own format (``model_type: dmtp``), whatever the method named."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") == "dmtp"
    except (OSError, ValueError, AttributeError):
        return False


def install() -> None:
    """Wrap the model runner's constructor so that a DMTP draft gets a `DMTPProposer`, and check draft folders before
    the target loads (idempotent)."""
    import vllm
    from vllm.v1.worker import gpu_model_runner

    check_version(vllm.__version__)
    fix_cpu_expand_kernel()
    check_drafts_before_loading()
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
        elif os.environ.get("DMTP_VLLM_PROPOSAL_LOG") == "1" and hasattr(self, "drafter"):
            from .report import log_own_proposals

            log_own_proposals(self)  # vLLM's own drafter, for tests that compare its proposals with DMTP's

    __init__._dmtp_installed = True  # type: ignore[attr-defined]
    runner_class.__init__ = __init__
    # `llm.collective_rpc("dmtp_policy_report")` reads what the policy chose from every worker (and what the draft
    # proposed: "dmtp_proposal_log")
    from vllm.v1.worker.worker_base import WorkerBase

    from .report import policy_report, proposal_log

    WorkerBase.dmtp_policy_report = policy_report
    WorkerBase.dmtp_proposal_log = proposal_log
