"""Draft vocabularies: a draft that predicts over a frequency-ranked subset of the target's vocabulary.

The draft's LM head is the target's own, restricted to the subset's rows, so a round's draft logits cost
``draft_vocab / vocab`` of the full head (SmolLM2: 8,192 of 49,152 rows). Checkpoints store the subset in EAGLE-3's
layout (FR-Spec uses the same idea):

- ``d2t`` int64 ``[draft_vocab]``: offsets, ``target_id = draft_id + d2t[draft_id]`` (ids ascending);
- ``t2d`` bool ``[vocab]``: whether a target token is in the subset.

At generation the subset's logits are scattered back into the full vocabulary with ``-inf`` elsewhere: logits
processors see the vocabulary they expect, greedy picks a subset token, and a sampled draft's ``q`` is exactly zero
outside the subset, which token-wise and block verification handle like any other ``q`` (lossless). Training uses
the subset logits directly; answers' tokens outside the subset are ignored by the draft's loss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
DRAFT_VOCAB_TENSORS = ("d2t", "t2d")  # the buffers' names, in every checkpoint that holds a draft vocabulary


def register_draft_vocabulary(model: nn.Module, draft_vocab_size: int | None, vocab_size: int) -> None:
    """Give ``model`` the ``d2t``/``t2d`` buffers (saved with it) of a ``draft_vocab_size`` subset; ``None``: none."""
    if draft_vocab_size is None:
        model.d2t = model.t2d = None
        return
    # the first `draft_vocab_size` ids until filled (`set_draft_vocabulary`) or loaded
    model.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
    model.register_buffer("t2d", torch.arange(vocab_size) < draft_vocab_size)


def set_draft_vocabulary(model: nn.Module, token_ids: torch.Tensor | Iterable[int]) -> None:
    """Fill ``model``'s buffers with the subset ``token_ids`` (target ids, any order, as many as ``d2t`` holds)."""
    ids = torch.as_tensor(list(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids, dtype=torch.long)
    ids = torch.unique(ids)  # sorted ascending, as the offset layout needs
    if ids.numel() != model.d2t.numel():
        raise ValueError(f"The draft vocabulary holds {model.d2t.numel()} tokens, got {ids.numel()} distinct ids.")
    if ids.min() < 0 or ids.max() >= model.t2d.numel():
        raise ValueError(f"Draft vocabulary ids must lie in 0..{model.t2d.numel() - 1}.")
    with torch.no_grad():
        model.d2t.copy_(ids.to(model.d2t.device) - torch.arange(ids.numel(), device=model.d2t.device))
        model.t2d.zero_()
        model.t2d[ids.to(model.t2d.device)] = True


def draft_token_ids(model: nn.Module) -> torch.Tensor:
    """The subset's target ids ``[draft_vocab]`` (ascending)."""
    return torch.arange(model.d2t.numel(), device=model.d2t.device) + model.d2t


def to_draft_ids(model: nn.Module, target_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids, ``IGNORE_INDEX`` for tokens outside the subset (labels for the draft's loss)."""
    index = torch.cumsum(model.t2d.long(), 0) - 1  # [V]: a subset token's rank among the subset
    return torch.where(model.t2d[target_ids], index[target_ids], IGNORE_INDEX)


def subset_head_logits(model: nn.Module, head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``head`` (the target's LM head) over the subset's rows only: ``[..., draft_vocab]``. The gathered rows are
    cached per weight version, device and dtype (the target head is frozen; a training step sees it unchanged)."""
    weight = head.weight
    d2t = model.d2t  # a vocabulary set again (same buffer, new version) or replaced (new buffer) invalidates the rows
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, d2t.data_ptr(), d2t.numel(), d2t._version)
    cached = getattr(model, "_subset_head_cache", None)
    if cached is None or cached[0] != key:
        rows = draft_token_ids(model).to(weight.device)
        bias = getattr(head, "bias", None)
        cached = (key, weight.detach()[rows], bias.detach()[rows] if bias is not None else None)
        model.__dict__["_subset_head_cache"] = cached  # not a buffer: never saved, never moved by `.to`
    return F.linear(hidden_states.to(weight.dtype), cached[1], cached[2])


def scatter_to_vocabulary(model: nn.Module, subset_logits: torch.Tensor) -> torch.Tensor:
    """Subset logits ``[..., draft_vocab]`` -> full-vocabulary logits ``[..., vocab]``, ``-inf`` outside the subset."""
    shape = (*subset_logits.shape[:-1], model.t2d.numel())
    full = subset_logits.new_full(shape, float("-inf"))
    return full.index_copy_(-1, draft_token_ids(model).to(subset_logits.device), subset_logits)


def draft_logits(model: nn.Module, head: nn.Module, hidden_states: torch.Tensor, subset: bool = False) -> torch.Tensor:
    """A draft's logits through the target's LM ``head``, with DFlash's optional output multiplier and softcap. With
    a draft vocabulary the head runs over the subset's rows: ``subset=True`` returns ``[..., draft_vocab]``,
    otherwise they are scattered into the full vocabulary (``-inf`` elsewhere)."""
    if model.d2t is not None:
        logits = subset_head_logits(model, head, hidden_states)
    else:
        logits = head(hidden_states.to(head.weight.dtype))
    multiplier = model.config.dflash_config.get("output_multiplier")
    if multiplier not in (None, 1, 1.0):
        logits = logits * multiplier
    softcap = model.config.dflash_config.get("final_logit_softcapping")
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return scatter_to_vocabulary(model, logits) if model.d2t is not None and not subset else logits


def frequency_ranked_vocabulary(
    token_streams: Iterable[Iterable[int]], size: int, vocab_size: int, always: Iterable[int] = ()
) -> tuple[list[int], dict[str, float]]:
    """The ``size`` most frequent target tokens of ``token_streams`` (the training answers), ties by id, with
    ``always`` (EOS, pad, special tokens) included first. Returns ``(ids, stats)``; ``stats["coverage"]`` is the share
    of the streams' tokens inside the subset."""
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(int(t) for t in stream)
    chosen = list(dict.fromkeys(int(t) for t in always if 0 <= int(t) < vocab_size))[:size]
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    taken = set(chosen)
    for token, _ in ranked:
        if len(chosen) == size:
            break
        if token not in taken and 0 <= token < vocab_size:
            chosen.append(token)
            taken.add(token)
    filler = (t for t in range(vocab_size) if t not in taken)  # fewer distinct tokens than `size`: pad by id
    while len(chosen) < size:
        token = next(filler)
        chosen.append(token)
        taken.add(token)
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t in taken)
    return sorted(chosen), {"coverage": covered / total if total else 1.0, "distinct_tokens": len(counts)}


def coverage(model: nn.Module, token_streams: Iterable[Iterable[int]]) -> float:
    """The share of ``token_streams``' tokens (e.g. held-out answers) inside ``model``'s draft vocabulary."""
    inside = total = 0
    t2d = model.t2d.cpu()
    for stream in token_streams:
        ids = torch.as_tensor(list(stream), dtype=torch.long)
        inside += int(t2d[ids].sum())
        total += ids.numel()
    return inside / total if total else 1.0
