"""Extract the target hidden state an MTP head consumes: post-final-norm (default) or pre-final-norm.

Post-norm ``h_t`` is the tensor fed to the LM head; in Transformers it is ``outputs.hidden_states[-1]`` (the last
captured entry is replaced by ``last_hidden_state``). Pre-norm ``h_t`` is the last decoder layer's output before the
final norm; no output field holds it, so a forward hook on the target's final norm captures the norm's input.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import PreTrainedModel

from .head import HIDDEN_INPUTS, HiddenInput

__all__ = ["TargetHiddenExtractor"]


def on_thread(thread: int) -> bool:
    """Whether this forward runs on ``thread``. Hooks use it to ignore other threads' forwards of a shared target;
    inside a compiled forward (traced once, run on the calling thread) the check is skipped, as Dynamo cannot trace
    ``threading.get_ident``."""
    return torch.compiler.is_compiling() or threading.get_ident() == thread


class TargetHiddenExtractor:
    """Capture the target hidden states an MTP head is fed, for every forward of ``target``.

    A forward hook on the target's final norm records its input (``"pre_norm"``) or output (``"post_norm"``) of
    the latest forward, so it works whether or not the forward returned hidden states. Use it as a context manager
    (or call `remove`) to detach the hook.

    Example::

        with TargetHiddenExtractor(target, head.hidden_input) as extract:
            outputs = target(input_ids)
            hidden = extract(outputs)  # [B, T, H]
    """

    def __init__(self, target: PreTrainedModel, hidden_input: HiddenInput = "post_norm"):
        if hidden_input not in HIDDEN_INPUTS:
            raise ValueError(f"hidden_input must be one of {HIDDEN_INPUTS}, got {hidden_input!r}")
        self.hidden_input = hidden_input
        self.final_norm = target.get_decoder().norm
        self._captured: torch.Tensor | None = None
        self._thread = threading.get_ident()  # forwards of other threads (another generate call) are not ours
        self._handle = self.final_norm.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        if not on_thread(self._thread):
            return
        if self.hidden_input == "pre_norm":
            self._captured = args[0] if args else next(iter(kwargs.values()))
        else:
            self._captured = output

    def __call__(self, outputs: Any | None = None) -> torch.Tensor:
        """The hidden states ``[B, T, H]`` of the latest target forward.

        For ``"post_norm"``, ``outputs.hidden_states[-1]`` is used when the forward returned it (identical to the
        captured norm output); otherwise the captured tensor.
        """
        if self.hidden_input == "post_norm" and outputs is not None:
            hidden_states = getattr(outputs, "hidden_states", None)
            if hidden_states is not None and hidden_states[-1] is not None:
                return hidden_states[-1]
        if self._captured is None:
            raise RuntimeError("No target forward has run since the extractor was attached")
        return self._captured

    def remove(self) -> None:
        """Detach the hook from the target's final norm."""
        self._handle.remove()
        self._captured = None

    def __enter__(self) -> TargetHiddenExtractor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()
