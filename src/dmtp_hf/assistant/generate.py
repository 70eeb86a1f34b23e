"""Entry points: ``target.generate(**inputs, assistant_model=dmtp)``, ``custom_generate`` and ``dmtp_hf.generate``.

Stock assisted decoding refuses stateful (hybrid linear-attention) targets and drives only its own candidate
generators. Binding a draft to its target (``DMTPDraftModel.from_pretrained(path, target=target)`` or
``draft.bind(target)``) installs a thin per-instance router on ``target.generate``: when ``assistant_model`` is a
DMTP draft (or any :class:`Drafter`), the call is forwarded to Transformers' sanctioned ``custom_generate`` hook
with :func:`dmtp_custom_generate`, so input preparation, generation config, logits processors (temperature,
top-k/p, ...), stopping criteria, ``max_new_tokens`` and EOS handling stay Transformers' own. Every other call goes
to the original ``generate`` untouched.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import StaticCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .decoding import speculative_decode
from .drafters import DFlashDrafter, DMTPDrafter, Drafter, MTPDrafter
from .stats import SpecStats
from .target_state import static_capacity


@dataclass
class DMTPGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the speculative statistics of the call (``spec_stats``)."""

    spec_stats: SpecStats | None = None


def as_drafter(
    assistant: Any, *, strategy: str | None = None, mtp_steps: int = 1, fast_path: bool = False,
    cuda_graphs: bool = True,
) -> Drafter | None:  # fmt: skip
    """The :class:`Drafter` for ``assistant`` (a bound ``DMTPDraftModel``, a native MTP head, or a drafter).

    ``strategy`` overrides the default for a draft model: ``"dmtp"`` (layout ``single``/``dual``), ``"dflash"``
    (layout ``dflash``) or ``"mtp"`` (its bound native MTP head alone, chained ``mtp_steps`` times).
    ``fast_path`` keeps the drafter state in fixed device-side slots (``fast_path.py``) and, on CUDA with
    ``cuda_graphs``, replays the greedy MTP / T1 / DFlash stages as CUDA graphs; the tokens are the same.
    Returns ``None`` for anything else (so the router leaves the call to Transformers).
    """
    from ..modeling.modeling_dmtp import DMTPDraftModel
    from ..modeling.native_mtp.head import NativeMTPHead
    from .fast_path import FastDFlashDrafter, FastDMTPDrafter, FastMTPDrafter

    if isinstance(assistant, Drafter):
        return assistant
    # The fast-path drafters take the same arguments, plus whether to capture CUDA graphs.
    extra = {"cuda_graphs": cuda_graphs} if fast_path else {}
    mtp_class, dflash_class, dmtp_class = (
        (FastMTPDrafter, FastDFlashDrafter, FastDMTPDrafter) if fast_path else (MTPDrafter, DFlashDrafter, DMTPDrafter)
    )
    if isinstance(assistant, NativeMTPHead):
        return mtp_class(assistant, mtp_steps, **extra)
    if not isinstance(assistant, DMTPDraftModel):
        return None
    strategy = strategy or ("dflash" if assistant.config.anchor_layout == "dflash" else "dmtp")
    if strategy == "dflash":
        return dflash_class(assistant, **extra)
    if strategy == "mtp":
        return mtp_class(assistant.native_mtp, mtp_steps, **extra)
    if strategy == "dmtp":
        return dmtp_class(assistant, assistant.native_mtp, **extra)
    raise ValueError(f"Unknown drafting strategy {strategy!r}; expected 'dmtp', 'dflash' or 'mtp'.")


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
    dmtp_draft_sampling: bool | None = None,
    dmtp_profile: bool = False,
    **model_kwargs,
):
    """A ``custom_generate`` decoding method: ``target.generate(..., custom_generate=dmtp_custom_generate,
    dmtp_drafter=drafter)``. Returns sequences, or a :class:`DMTPGenerateOutput` with ``return_dict_in_generate``.
    """
    if dmtp_drafter is None:
        raise ValueError("dmtp_custom_generate needs `dmtp_drafter=` (see dmtp_hf.as_drafter).")
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    capacity = static_capacity(cache) if cache is not None else None
    needed = generation_config.max_length + dmtp_drafter.num_candidates + 1
    if capacity is not None and capacity < needed:
        # Transformers sized it for `max_length - 1`; a verify writes K + 1 slots past the committed tokens.
        cache = StaticCache(config=model.config, max_cache_len=needed)
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
        draft_sampling=dmtp_draft_sampling,
        streamer=dmtp_streamer,
        profile=dmtp_profile,
    )
    dmtp_drafter.last_stats = stats
    if generation_config.return_dict_in_generate:
        return DMTPGenerateOutput(sequences=sequences, cache=cache, spec_stats=stats)
    return sequences


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
    **generate_kwargs: Any,
):
    """Speculative ``generate`` with a DMTP draft, a DFlash draft or a native MTP head, via ``custom_generate``.

    Equivalent to ``target.generate(input_ids, assistant_model=assistant, **generate_kwargs)`` on a bound target,
    with the drafting ``strategy`` ("dmtp", "dflash", "mtp") and ``verify_mode`` ("greedy", "match",
    "rejection") made explicit; ``fast_path=True`` uses the fixed-slot drafters (CUDA graphs on GPU).
    """
    drafter = as_drafter(assistant, strategy=strategy, mtp_steps=mtp_steps, fast_path=fast_path)
    if drafter is None:
        raise TypeError(
            f"Cannot draft with {type(assistant).__name__}; pass a DMTPDraftModel, NativeMTPHead or Drafter."
        )
    original = getattr(target, "_dmtp_original_generate", target.generate)
    return original(
        input_ids,
        custom_generate=dmtp_custom_generate,
        dmtp_drafter=drafter,
        dmtp_streamer=streamer,
        dmtp_verify_mode=verify_mode,
        dmtp_draft_sampling=draft_sampling,
        dmtp_profile=profile,
        **generate_kwargs,
    )


def install_generate_router(target) -> None:
    """Make ``target.generate(..., assistant_model=<DMTP draft or Drafter>)`` run DMTP decoding (idempotent)."""
    if getattr(target, "_dmtp_original_generate", None) is not None:
        return
    original = target.generate

    def routed_generate(self, *args, assistant_model=None, streamer=None, dmtp_fast_path=False, **kwargs):
        drafter = as_drafter(assistant_model, fast_path=dmtp_fast_path)
        if drafter is None:
            return original(*args, assistant_model=assistant_model, streamer=streamer, **kwargs)
        return original(
            *args, custom_generate=dmtp_custom_generate, dmtp_drafter=drafter, dmtp_streamer=streamer, **kwargs
        )

    target._dmtp_original_generate = original
    target.generate = types.MethodType(routed_generate, target)
