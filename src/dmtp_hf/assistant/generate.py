"""Entry points into the engine through Transformers' ``custom_generate`` hook: :func:`dmtp_custom_generate` and
:func:`generate` (``dmtp_hf.generate``). Input preparation, generation config, logits processors (temperature,
top-k/p, ...), stopping criteria, ``max_new_tokens`` and EOS handling stay Transformers' own.

``target.generate(**inputs, assistant_model=dmtp)`` reaches the same hook through the router (``router.py``).
"""

from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import CompileConfig, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..machine import thread_oversubscription_once
from ..modeling.binding import UNBOUND_ASSISTANT
from ..modeling.modeling_dmtp import DMTPDraftModel
from ..modeling.native_mtp.head import NativeMTPHead
from .accept.batch import StepOutputs
from .decoding import speculative_decode, target_cache
from .drafters.base import Drafter
from .drafters.dflash import DFlashDrafter
from .drafters.dmtp import DMTPDrafter
from .drafters.mtp import MTPDrafter
from .options import check_generate_options
from .stats import SpecStats
from .target.cache import refill_in_plain_layout

ROUTER_ORIGINAL = "_dmtp_original_generate"  # where the router keeps a target's own `generate`


@dataclass
class DMTPGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the speculative statistics of the call (``spec_stats``)."""

    spec_stats: SpecStats | None = None


def _is_a(obj: Any, cls: type) -> bool:
    """``isinstance``, or the same class loaded from another copy of this code (a Hub repo's remote modules)."""
    return isinstance(obj, cls) or any(
        base.__name__ == cls.__name__ and base.__module__.rsplit(".", 1)[-1].endswith(cls.__module__.rsplit(".", 1)[-1])
        for base in type(obj).__mro__
    )


def as_drafter(
    assistant: Any,
    *,
    strategy: str | None = None,
    mtp_steps: int = 1,
    fast_path: bool = False,
    cuda_graphs: bool = True,
) -> Drafter | None:
    """The :class:`Drafter` for ``assistant`` (a bound ``DMTPDraftModel``, a native MTP head, or a drafter).

    ``strategy`` overrides the default for a draft model: ``"dmtp"`` (layout ``single``/``dual``), ``"dflash"``
    (layout ``dflash``) or ``"mtp"`` (its bound native MTP head alone, chained ``mtp_steps`` times).
    ``fast_path`` runs the drafter state at fixed shapes (``drafters/state.py``) and, on CUDA with ``cuda_graphs``,
    replays the fixed-shape stages as CUDA graphs; the tokens are the same.
    Returns ``None`` for anything else (so the router leaves the call to Transformers).
    """
    if isinstance(assistant, Drafter):
        return assistant
    backend = {"fixed_shapes": fast_path, "cuda_graphs": cuda_graphs}
    if _is_a(assistant, NativeMTPHead):
        return MTPDrafter(assistant, mtp_steps, **backend)
    if not _is_a(assistant, DMTPDraftModel):
        return None
    if assistant.__dict__.get("_target") is None:  # else the first round fails on a missing MTP head or target
        raise ValueError(UNBOUND_ASSISTANT)
    strategy = strategy or ("dflash" if assistant.config.anchor_layout == "dflash" else "dmtp")
    if strategy == "dflash":
        return DFlashDrafter(assistant, **backend)
    if strategy == "mtp":
        return MTPDrafter(assistant.native_mtp, mtp_steps, **backend)
    if strategy == "dmtp":
        return DMTPDrafter(assistant, assistant.native_mtp, **backend)
    raise ValueError(f"Unknown drafting strategy {strategy!r}; expected 'dmtp', 'dflash' or 'mtp'.")


def route_kwargs(target, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate`` keyword arguments for the ``custom_generate`` hook, with stop strings made into a criterion.

    Transformers drops ``tokenizer`` before it calls a ``custom_generate`` callable yet still builds the stop-string
    criterion, which needs it; so stop strings (argument or generation config) become a ``StopStringCriteria`` here,
    built with the caller's tokenizer, and are removed from what ``generate`` sees.
    """
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or target.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if not stop_strings:
        return kwargs
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass `tokenizer=` to generate.")
    if getattr(config, "stop_strings", None):
        kwargs["generation_config"] = copy.deepcopy(config)
        kwargs["generation_config"].stop_strings = None
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    return kwargs


def engine_kwargs(target, drafter: Drafter, streamer, kwargs: dict[str, Any], **options: Any) -> dict[str, Any]:
    """What a ``generate`` call needs to run in the engine: Transformers' ``custom_generate`` hook set to
    :func:`dmtp_custom_generate` with ``drafter`` (and ``options``: ``dmtp_verify_mode``, ...), stop strings made
    into a criterion (`route_kwargs`). Every entry point (``dmtp_hf.generate``, the ``target.generate`` router, a
    pushed repo's ``custom_generate``) goes through here; options that cannot be exact are refused first."""
    check_generate_options(target, kwargs)
    # a cache of the caller's is theirs to continue: at batch size > 1 the engine leaves it in plain layout
    cache_given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    return {
        "custom_generate": dmtp_custom_generate,
        "dmtp_drafter": drafter,
        "dmtp_streamer": streamer,
        **options,
        "dmtp_cache_given": cache_given,
        **route_kwargs(target, kwargs),
    }


def dmtp_custom_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    dmtp_drafter: Drafter | None = None,
    dmtp_streamer=None,
    dmtp_verify_mode: str | None = None,
    dmtp_verify_length: int | str | None = None,
    dmtp_prompt_lookup: bool | None = None,
    dmtp_draft_sampling: bool | None = None,
    dmtp_profile: bool = False,
    dmtp_compile: bool | CompileConfig = False,
    dmtp_cache_given: bool = False,
    **model_kwargs,
):
    """A ``custom_generate`` decoding method: ``target.generate(..., custom_generate=dmtp_custom_generate,
    dmtp_drafter=drafter)``. Returns sequences, or a :class:`DMTPGenerateOutput` with ``return_dict_in_generate``.
    """
    if dmtp_drafter is None:
        raise ValueError("dmtp_custom_generate needs `dmtp_drafter=` (see dmtp_hf.as_drafter).")
    _warn_once_if_threads_outnumber_free_cores()
    check_generate_options(model, {**model_kwargs, "generation_config": generation_config})
    compile_config = compiled_verify_config(model, dmtp_compile, generation_config)
    cache = target_cache(  # the cache the call runs on (and returns): the engine's one rule
        model,
        model_kwargs.get("cache") or model_kwargs.get("past_key_values"),
        input_ids.shape[0],
        generation_config.max_length,
        dmtp_drafter.num_candidates,
        compile_config,
    )
    dict_out = generation_config.return_dict_in_generate
    outputs = None
    if dict_out and (generation_config.output_scores or generation_config.output_logits):
        outputs = StepOutputs(bool(generation_config.output_scores), bool(generation_config.output_logits))
    sequences, stats = speculative_decode(
        model,
        input_ids,
        dmtp_drafter,
        max_length=generation_config.max_length,
        attention_mask=model_kwargs.get("attention_mask"),
        pad_token_id=None if generation_config._pad_token_tensor is None else int(generation_config._pad_token_tensor),
        do_sample=bool(generation_config.do_sample),
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        eos_token_id=generation_config._eos_token_tensor,
        cache=cache,
        verify_mode=dmtp_verify_mode,
        verify_length=dmtp_verify_length,
        prompt_lookup=dmtp_prompt_lookup,
        draft_sampling=dmtp_draft_sampling,
        streamer=dmtp_streamer,
        profile=dmtp_profile,
        outputs=outputs,
        compile_config=compile_config,
    )
    if input_ids.shape[0] > 1 and (dict_out or dmtp_cache_given) and generation_config.use_cache is not False:
        refill_in_plain_layout(model, cache, sequences, model_kwargs.get("attention_mask"))  # the next turn's cache
    if not dict_out:
        return sequences
    steps = sequences.shape[1] - input_ids.shape[1]
    return DMTPGenerateOutput(
        sequences=sequences,
        cache=cache,
        spec_stats=stats,
        scores=outputs and outputs.steps("scores", steps),
        logits=outputs and outputs.steps("logits", steps),
    )


def _warn_once_if_threads_outnumber_free_cores() -> None:
    """Warn (the first call per process only: the check measures the load for a moment) when torch's intra-op threads
    outnumber the free cores: on a busy machine that makes speculative decoding slower than plain decoding."""
    message = thread_oversubscription_once(torch.get_num_threads())
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this library, Transformers and torch: the caller's ``generate``
    line (the router and Transformers' ``generate`` lie between, at a depth that depends on the entry point)."""
    inner = ("dmtp_hf", "transformers", "torch")
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in inner:
        frame, level = frame.f_back, level + 1
    return level


def compiled_verify_config(target, compile: bool | CompileConfig, generation_config=None) -> CompileConfig | None:
    """The ``CompileConfig`` of a compiled verify (``None``: eager). ``True``: the generation config's
    ``compile_config`` if it has one, else Transformers' default on CUDA (CUDA graphs) and plain inductor
    (``mode="default"``, static shapes) elsewhere."""
    if compile is False or compile is None:
        return None
    if isinstance(compile, CompileConfig):
        return compile
    configured = getattr(generation_config, "compile_config", None)
    if configured is not None:
        return configured
    on_cuda = target.get_input_embeddings().weight.device.type == "cuda"
    return CompileConfig() if on_cuda else CompileConfig(fullgraph=False, dynamic=False, mode="default")


def generate(
    target,
    input_ids: torch.LongTensor | None = None,
    assistant: Any = None,
    *,
    strategy: str | None = None,
    mtp_steps: int = 1,
    verify_mode: str | None = None,
    draft_sampling: bool | None = None,
    profile: bool = False,
    streamer=None,
    fast_path: bool = False,
    verify_length: int | str | None = None,
    prompt_lookup: bool | None = None,
    compile: bool | CompileConfig = False,
    **generate_kwargs: Any,
):
    """Speculative ``generate`` with a DMTP draft, a DFlash draft or a native MTP head, via ``custom_generate``.

    Equivalent to ``target.generate(input_ids, assistant_model=assistant, **generate_kwargs)`` on a bound target,
    with the drafting ``strategy`` ("dmtp", "dflash", "mtp") and ``verify_mode`` ("greedy", "match",
    "rejection", "block") made explicit; ``fast_path=True`` runs the drafters at fixed shapes (CUDA graphs on GPU);
    ``compile=True`` (or a ``CompileConfig``) compiles the target's verify forward over a static cache (batch 1);
    ``prompt_lookup`` (default: on with ``verify_length="auto"``) lets prompt-lookup proposals compete with the
    draft's, row by row.
    """
    drafter = as_drafter(assistant, strategy=strategy, mtp_steps=mtp_steps, fast_path=fast_path)
    if drafter is None:
        raise TypeError(
            f"Cannot draft with {type(assistant).__name__}; pass a DMTPDraftModel, NativeMTPHead or Drafter."
        )
    original = getattr(target, ROUTER_ORIGINAL, target.generate)
    options = {
        "dmtp_verify_mode": verify_mode,
        "dmtp_draft_sampling": draft_sampling,
        "dmtp_profile": profile,
        "dmtp_verify_length": verify_length,
        "dmtp_prompt_lookup": prompt_lookup,
        "dmtp_compile": compile,
    }
    return original(input_ids, **engine_kwargs(target, drafter, streamer, generate_kwargs, **options))
