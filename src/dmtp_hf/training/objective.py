"""The training objective shared by DMTP and the DFlash baseline: anchors, blocks, masks, loss and metrics.

Read top to bottom:

1. ``anchor_scores`` / ``sample_anchors``: up to ``num_anchors`` distinct random anchors per sequence among the valid
   positions (``loss_mask`` on the anchor and on the next token, as SpecForge's current HEAD; single/dual layouts
   also need ``a >= 1`` so that ``g_{a-1}``, the MTP hidden predicting ``x_{a+1}``, exists).
2. ``plan_blocks``: everything that depends only on the data and the anchors (labels, slot weights), so the
   trainer can know the global loss normaliser before any forward.
3. ``build_attention_masks``: the training layout of the one draft mask rule (``attention_masks.py``), as a dense
   boolean mask (SDPA/eager) or as a FlexAttention ``BlockMask`` whose ``mask_mod`` evaluates the same rule.
4. ``DMTPTrainingObjective``: the ``nn.Module`` that accelerate wraps (DDP/FSDP/DeepSpeed): it builds the blocks
   with ``draft.block_embeddings`` (T1 = the dataset token ``x_{a+1}``, MTP hidden = ``g_{a-1}``), runs the draft
   once over ``[context S | all blocks]`` and returns the decayed cross-entropy on the MASK slots plus metrics.

Block layouts for an anchor ``a`` (``A = x_a``; label of a slot = the token at that slot's absolute position):

=========  ===========================================  =============  ==================
layout     slots                                        positions      predicted slots
=========  ===========================================  =============  ==================
dflash     ``[x_a, MASK x 7]``                          a .. a+7       1..7 -> x_{a+1..a+7}
single     ``[fuse(x_{a+1}), MASK x 6]``                a+1 .. a+7     1..6 -> x_{a+2..a+7}
dual       ``[x_a, x_{a+1} + Δ, MASK x 6]``             a .. a+7       2..7 -> x_{a+2..a+7}
=========  ===========================================  =============  ==================

Context visibility is strict (``kv_pos < a``, the target has not processed A yet) for every layout; blocks see
only themselves; padding blocks see only themselves (never an all-masked row) and carry zero weight.

Shapes: ``B`` batch, ``S`` sequence, ``N`` blocks per sequence, ``L`` block length, ``P`` predicted slots per block,
``H`` hidden, ``k`` target feature layers, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..modeling.attention_masks import AttentionLayout, draft_attention_masks, layer_kinds
from ..modeling.configuration_dmtp import DMTPConfig
from ..modeling.draft_vocab import IGNORE_INDEX, draft_token_ids, to_draft_ids
from ..modeling.modeling_dmtp import DMTPDraftModel, block_slot_positions
from .protocol import TrainingObjective, unwrap_peft

__all__ = [
    "BlockPlan",
    "DMTPTrainingObjective",
    "ObjectiveOutput",
    "anchor_scores",
    "build_attention_masks",
    "chunked_rows",
    "metric_vector",
    "metrics_from_vector",
    "plan_blocks",
    "sample_anchors",
    "summarize_metrics",
    "valid_anchor_mask",
]

# Larger than any score drawn from [0, 1): marks positions that cannot be anchors.
_INVALID_SCORE = 2.0


# ----------------------------------------------------------------------------------------------------
# 1. Anchors


def anchor_scores(seed: int, step: int, num_rows: int, length: int) -> torch.Tensor:
    """Uniform scores ``[num_rows, length]`` for anchor sampling, a pure function of ``(seed, step)``.

    The trainer draws one tensor for the whole *global* batch and hands each rank / micro-batch its rows, so the
    anchors of a sample do not depend on how the global batch is split across processes or accumulation steps
    (what makes a 2-process run equal a 1-process run) nor on any RNG state (what makes resume exact).
    """
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    return torch.rand(num_rows, length, generator=generator)


def valid_anchor_mask(loss_mask: torch.Tensor, anchor_layout: str) -> torch.Tensor:
    """``[B, S]`` bool: positions ``a`` with ``loss_mask[a] = loss_mask[a + 1] = 1`` (and ``a >= 1`` unless dflash)."""
    supervised = loss_mask.bool()
    valid = torch.zeros_like(supervised)
    valid[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    if anchor_layout != "dflash":
        valid[:, 0] = False  # g_{a-1} must exist
    return valid


def sample_anchors(
    valid: torch.Tensor,  # [B, S] bool
    scores: torch.Tensor,  # [B, S] in [0, 1)
    num_anchors: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick up to ``num_anchors`` distinct valid positions per row (the lowest scores), sorted by position.

    Returns ``anchors [B, N]`` (0 in padding blocks) and ``keep [B, N]`` (False for padding blocks), with
    ``N = min(num_anchors, max valid count in the batch)`` (at least 1, so shapes never collapse).
    """
    seq_len = valid.shape[1]
    num_blocks = max(1, min(num_anchors, int(valid.sum(dim=1).max().item()), seq_len))
    masked = torch.where(valid, scores.to(valid.device), torch.full_like(scores, _INVALID_SCORE, device=valid.device))
    chosen_scores, positions = masked.topk(num_blocks, dim=1, largest=False)  # [B, N]
    keep = chosen_scores < _INVALID_SCORE
    # Sort kept anchors by position; padding blocks go last.
    order = torch.where(keep, positions, torch.full_like(positions, seq_len)).argsort(dim=1)
    positions, keep = positions.gather(1, order), keep.gather(1, order)
    return torch.where(keep, positions, torch.zeros_like(positions)), keep


# ----------------------------------------------------------------------------------------------------
# 2. Block plan (data only, no model)


@dataclass
class BlockPlan:
    """Anchors, labels and loss weights of a batch; everything the loss needs that does not involve the model."""

    anchors: torch.Tensor  # [B, N] anchor positions a (0 for padding blocks)
    keep: torch.Tensor  # [B, N] bool, False for padding blocks
    labels: torch.Tensor  # [B, N, P] token at each predicted slot's absolute position (clamped when out of range)
    t1_labels: torch.Tensor  # [B, N] the token at a + 1 that T1 must match (acceptance metric)
    valid: torch.Tensor  # [B, N, P] bool: kept block, position < S and loss_mask = 1
    weights: torch.Tensor  # [B, N, P] float: valid * exp(-(j - 1) / gamma)
    predecessors: torch.Tensor  # [B, N, P] the token just before each predicted slot (DFlash2's walk, teacher-forced)

    @property
    def weight_sum(self) -> torch.Tensor:
        """Scalar sum of the slot weights (the local loss normaliser)."""
        return self.weights.sum()

    def to(self, device: torch.device | str) -> BlockPlan:
        """The plan on ``device``."""
        return BlockPlan(**{k: v.to(device) for k, v in self.__dict__.items()})


def slot_decay(num_predicted: int, gamma: float | None, device: torch.device | str | None = None) -> torch.Tensor:
    """``exp(-(j - 1) / gamma)`` for ``j = 1..P`` (all ones when ``gamma`` is None)."""
    j = torch.arange(num_predicted, device=device, dtype=torch.float32)
    return torch.ones_like(j) if gamma is None else torch.exp(-j / gamma)


def plan_blocks(
    input_ids: torch.Tensor,  # [B, S]
    loss_mask: torch.Tensor,  # [B, S]
    scores: torch.Tensor,  # [B, >= S] anchor scores, see `anchor_scores`
    config: DMTPConfig,
    num_anchors: int,
    loss_decay_gamma: float | None,
    label_ids: torch.Tensor | None = None,  # [B, S] what each position must be predicted as (default: input_ids)
) -> BlockPlan:
    """Sample anchors and compute the labels and weights of every predicted slot.

    ``label_ids`` are the target's own tokens when training on teacher-forced text (`features.teacher_labels`); the
    walk of a DFlash2 selector then follows them too, since at inference it follows the draft's accepted picks."""
    label_ids = input_ids if label_ids is None else label_ids
    seq_len = input_ids.shape[1]
    valid_anchor = valid_anchor_mask(loss_mask, config.anchor_layout)
    anchors, keep = sample_anchors(valid_anchor, scores[:, :seq_len], num_anchors)

    predicted = block_slot_positions(anchors, config)[..., config.first_predicted_slot :]  # [B, N, P]
    in_range = predicted < seq_len
    flat = predicted.clamp(max=seq_len - 1).flatten(1)  # [B, N*P]
    labels = label_ids.gather(1, flat).view_as(predicted)
    predecessors = label_ids.gather(1, (flat - 1).clamp(min=0)).view_as(predicted)
    t1_labels = label_ids.gather(1, (anchors + 1).clamp(max=seq_len - 1))
    supervised = loss_mask.gather(1, flat).view_as(predicted).bool()
    valid = keep[..., None] & in_range & supervised
    decay = slot_decay(predicted.shape[-1], loss_decay_gamma, device=input_ids.device)
    return BlockPlan(
        anchors=anchors,
        keep=keep,
        labels=labels,
        t1_labels=t1_labels,
        valid=valid,
        weights=valid.float() * decay,
        predecessors=predecessors,
    )


# ----------------------------------------------------------------------------------------------------
# 3. Attention masks


def build_attention_masks(
    draft: DMTPDraftModel,
    anchors: torch.Tensor,  # [B, N]
    keep: torch.Tensor,  # [B, N]
    context_len: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, object]:
    """Masks for queries = all block slots ``[B, N*L]`` over keys = ``[context S | all blocks]``, per layer type.

    The training layout for `draft_attention_masks`: SDPA/eager get a dense ``[B, 1, N*L, S + N*L]`` mask,
    ``flex_attention`` a ``BlockMask`` evaluating the same rule. Padding blocks see no context
    (``context_end = 0``) but their own slots.
    """
    config = draft.config
    bsz, num_blocks = anchors.shape
    block_len, device = config.block_length, anchors.device
    query_positions = block_slot_positions(anchors, config).flatten(1)  # [B, Q]
    query_blocks = torch.arange(num_blocks, device=device).repeat_interleave(block_len).expand(bsz, -1)
    context_end = torch.where(keep, anchors, torch.zeros_like(anchors)).repeat_interleave(block_len, dim=1)
    context_positions = torch.arange(context_len, device=device).expand(bsz, -1)
    layout = AttentionLayout(
        query_positions=query_positions,
        key_positions=torch.cat([context_positions, query_positions], dim=1),  # [B, S + Q]
        key_blocks=torch.cat([torch.full_like(context_positions, -1), query_blocks], dim=1),
        query_blocks=query_blocks,
        context_end=context_end,  # strict: kv_pos < a
    )
    return draft_attention_masks(layout, layer_kinds(draft.layers), config._attn_implementation, dtype)


# ----------------------------------------------------------------------------------------------------
# 4. The objective module


@dataclass
class ObjectiveOutput:
    """Loss and metric sums of one micro-batch (sums, so they aggregate over batches and ranks)."""

    loss: torch.Tensor  # scalar: sum(w * CE) / normaliser
    weighted_ce: torch.Tensor  # scalar: sum(w * CE) (detached)
    weight_sum: torch.Tensor  # scalar: sum(w)
    correct: torch.Tensor  # [P] correct predictions per predicted slot j (valid slots)
    count: torch.Tensor  # [P] valid slots per j
    accept_sum: torch.Tensor  # scalar: sum over complete blocks of the simulated acceptance length
    accept_tf_sum: torch.Tensor  # scalar: same with T1 assumed accepted (teacher-forced T1)
    accept_blocks: torch.Tensor  # scalar: number of complete blocks


class DMTPTrainingObjective(TrainingObjective):
    """The draft plus the training objective, as one module for accelerate to wrap (a `TrainingObjective`).

    Args:
        draft: a bound `DMTPDraftModel`, or a PEFT model wrapping one (LoRA layers are injected in place, so the
            base model is called directly).
        loss_decay_gamma: ``gamma`` of the slot weights ``exp(-(j - 1) / gamma)``; None for uniform weights.

    Simulated acceptance length (per *complete* block: every predicted slot in range and supervised), SpecForge
    convention: ``1 + sum_k prod_{i<=k} correct_i`` over the proposals of a round (the leading 1 is the target's
    bonus token). For ``dflash`` the seven proposals are the draft's slots. For ``single``/``dual`` the first
    proposal is T1: ``accept_len`` uses the native MTP head's own greedy T1 (``mtp_token``, comparable with DFlash),
    ``accept_len_tf`` assumes T1 is accepted (teacher-forced T1, what the draft itself controls).
    """

    def __init__(
        self,
        draft: nn.Module,
        loss_decay_gamma: float | None = 4.0,
        logits_chunk_size: int | None = None,
        selector_loss_weight: float = 1.0,
    ):
        super().__init__()
        self.model = draft
        self.loss_decay_gamma = loss_decay_gamma
        self.logits_chunk_size = logits_chunk_size
        self.selector_loss_weight = selector_loss_weight

    @property
    def draft(self) -> DMTPDraftModel:
        """The underlying `DMTPDraftModel` (inside a PEFT wrapper when LoRA is on)."""
        return unwrap_peft(self.model)

    def trained_modules(self) -> dict[str, nn.Module]:
        """The draft (PEFT-wrapped when LoRA is on)."""
        return {"draft": self.model}

    def loss_normalizers(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``normalizer``: the slot weights of the micro-batch's blocks (`BlockPlan.weight_sum`)."""
        return {"normalizer": inputs["plan"].weight_sum}

    @staticmethod
    def metric_vector(outputs: Sequence[ObjectiveOutput]) -> torch.Tensor:
        """Summed metric sums of micro-batch outputs (what ranks all-reduce)."""
        return metric_vector(outputs)

    def empty_metric_vector(self, device) -> torch.Tensor:
        """Zeros shaped like `metric_vector` (a process without an eval batch)."""
        probe = self.draft.config.block_length - self.draft.config.first_predicted_slot
        return torch.zeros(5 + 2 * probe, device=device)

    @staticmethod
    def metrics_from_vector(vector: torch.Tensor) -> dict[str, float]:
        """``loss``, ``acc_j``, ``accept_len``, ``accept_len_tf``."""
        return metrics_from_vector(vector)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        context: torch.Tensor,  # [B, S, k*H] target features at target_layer_ids
        plan: BlockPlan,
        mtp_hidden: torch.Tensor | None = None,  # [B, S, H]: g_t (predicts x_{t+2}); unused by dflash
        mtp_token: torch.Tensor | None = None,  # [B, S]: argmax lm_head(g_t), for the acceptance metric
        normalizer: torch.Tensor | float | None = None,
        **_: object,  # inputs of other objectives (head training) that share the batch
    ) -> ObjectiveOutput:
        """Loss and metrics of one micro-batch; ``normalizer`` defaults to the local weight sum."""
        draft = self.draft
        config = draft.config
        bsz, seq_len = input_ids.shape
        anchors = plan.anchors
        num_blocks, block_len = anchors.shape[1], config.block_length
        first = config.first_predicted_slot

        # Block inputs: A = x_a, T1 = x_{a+1} (the dataset token), mtp hidden = g_{a-1} (the one predicting x_{a+1}).
        anchor_ids = input_ids.gather(1, anchors)  # [B, N]
        t1_ids = input_ids.gather(1, (anchors + 1).clamp(max=seq_len - 1))
        predicting = None
        if config.anchor_layout != "dflash" and mtp_hidden is not None:
            index = (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, mtp_hidden.shape[-1])
            predicting = mtp_hidden.gather(1, index).flatten(0, 1)  # [B*N, H]
        slots = draft.block_embeddings(anchor_ids.flatten(), t1_ids.flatten(), predicting)  # [B*N, L, H]
        slots = slots.view(bsz, num_blocks * block_len, -1)

        context_positions = torch.arange(seq_len, device=anchors.device).expand(bsz, -1)
        block_positions = block_slot_positions(anchors, config).flatten(1)
        position_ids = torch.cat([context_positions, block_positions], dim=1)  # [B, S + N*L]
        masks = build_attention_masks(draft, anchors, plan.keep, seq_len, dtype=slots.dtype)

        hidden = draft(slots, context, position_ids, attention_mask=masks).last_hidden_state
        hidden = hidden.view(bsz, num_blocks, block_len, -1)[:, :, first:]  # [B, N, P, H]

        # Logits only for supervised slots: [M, V] instead of [B, N, P, V]; in chunks of rows when asked.
        valid = plan.valid
        labels = plan.labels[valid]
        ce, predicted = supervised_cross_entropy(
            draft, hidden[valid], labels, self.logits_chunk_size, plan.predecessors[valid], self.selector_loss_weight
        )  # [M], [M]
        weighted_ce = (ce * plan.weights[valid]).sum()
        weight_sum = plan.weights.sum()
        if normalizer is None:
            normalizer = weight_sum.clamp(min=1e-6)
        loss = weighted_ce / normalizer

        with torch.no_grad():
            correct = torch.zeros_like(valid)
            correct[valid] = predicted == labels
            metrics = _acceptance(correct, valid, plan.keep, config.anchor_layout, plan.t1_labels, anchors, mtp_token)
        return ObjectiveOutput(
            loss=loss,
            weighted_ce=weighted_ce.detach(),
            weight_sum=weight_sum.detach(),
            correct=correct.sum(dim=(0, 1)).float(),
            count=valid.sum(dim=(0, 1)).float(),
            **metrics,
        )


def _cross_entropy_rows(draft: DMTPDraftModel, hidden, labels, predecessors=None, selector_weight: float = 1.0):
    """Per-row loss and prediction through the draft's LM head: the cross-entropy over the vocabulary, plus, with a
    DFlash2 backbone, ``selector_weight`` x the selector's cross-entropy over the top-k candidates (SpecForge's: the
    walk's score after the true previous token; rows whose label is not a candidate add nothing). The prediction is
    then the walk's pick. A draft vocabulary is trained over its own tokens (answers' tokens outside it add nothing)."""
    # [m, V], or [m, Vd] over a draft vocabulary (its columns are the target ids `token_ids`; never scattered here)
    logits = draft.compute_logits(hidden, subset=True).float()
    token_ids = draft_token_ids(draft) if draft.d2t is not None else None
    gold_ids = to_draft_ids(draft, labels) if token_ids is not None else labels
    loss = F.cross_entropy(logits, gold_ids, reduction="none", ignore_index=IGNORE_INDEX)
    selector = draft.candidate_selector
    if selector is None:
        predicted = logits.argmax(dim=-1)
        return loss, token_ids[predicted] if token_ids is not None else predicted
    candidates, scores = selector.scores(logits, selector.hidden_projection(hidden), predecessors, token_ids)
    gold = candidates == labels[:, None]
    covered = gold.any(dim=-1)
    selector_loss = F.cross_entropy(scores, gold.float().argmax(dim=-1), reduction="none") * covered
    return loss + selector_weight * selector_loss, candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0]


def supervised_cross_entropy(
    draft: DMTPDraftModel,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    predecessors: torch.Tensor | None = None,
    selector_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss ``[M]`` and prediction ``[M]`` of ``hidden`` ``[M, H]`` through the draft's LM head (and, for
    DFlash2, its candidate selector after ``predecessors`` ``[M]``: `_cross_entropy_rows`), ``chunk_size`` rows at
    a time, checkpointed (`chunked_rows`)."""
    if predecessors is None:
        predecessors = torch.zeros_like(labels)
    rows = (hidden, labels, predecessors)
    return chunked_rows(_cross_entropy_rows, draft, rows, selector_weight, chunk_size=chunk_size)


def chunked_rows(
    rows_fn: Callable[..., tuple[torch.Tensor, ...]],
    model: nn.Module,
    rows: Sequence[torch.Tensor | None],
    *options: Any,
    chunk_size: int | None,
) -> tuple[torch.Tensor, ...]:
    """``rows_fn(model, *rows, *options)``: per-row results ``[M]`` of row tensors ``[M, ...]`` (``None`` passes as
    is) that go through an LM head, ``chunk_size`` rows at a time.

    With gradients, each chunk is checkpointed: its ``[chunk_size, V]`` logits are recomputed in the backward pass
    rather than kept, so at most one chunk's logits exist at once (at a 150k vocabulary and 512 anchors x 7 slots,
    unchunked float logits alone take gigabytes). Without ``chunk_size`` every row goes through at once.
    """
    if not chunk_size:
        return rows_fn(model, *rows, *options)
    checkpointed = torch.is_grad_enabled() and rows[0].requires_grad
    results = []
    for start in range(0, max(rows[0].shape[0], 1), chunk_size):  # no rows: one empty chunk, empty results
        piece = [None if r is None else r[start : start + chunk_size] for r in rows]
        if checkpointed:
            results.append(checkpoint(rows_fn, model, *piece, *options, use_reentrant=False))
        else:
            results.append(rows_fn(model, *piece, *options))
    return tuple(torch.cat(parts) for parts in zip(*results, strict=True))


def _acceptance(
    correct: torch.Tensor,  # [B, N, P]
    valid: torch.Tensor,  # [B, N, P]
    keep: torch.Tensor,  # [B, N]
    anchor_layout: str,
    t1_labels: torch.Tensor,  # [B, N]
    anchors: torch.Tensor,  # [B, N]
    mtp_token: torch.Tensor | None,  # [B, S]
) -> dict[str, torch.Tensor]:
    complete = keep & valid.all(dim=-1)  # [B, N]
    accepted = correct.long().cumprod(dim=-1).sum(dim=-1).float()  # [B, N] accepted draft slots
    if anchor_layout == "dflash":
        accept, accept_tf = 1.0 + accepted, 1.0 + accepted
    else:
        accept_tf = 2.0 + accepted  # bonus + T1 (assumed accepted) + draft slots
        if mtp_token is not None:
            t1_ok = (mtp_token.gather(1, (anchors - 1).clamp(min=0)) == t1_labels).float()
            accept = 1.0 + t1_ok * (1.0 + accepted)
        else:
            accept = torch.full_like(accept_tf, math.nan)
    blocks = complete.float()
    return {
        "accept_sum": (accept * blocks).sum(),
        "accept_tf_sum": (accept_tf * blocks).sum(),
        "accept_blocks": blocks.sum(),
    }


def metric_vector(outputs: list[ObjectiveOutput]) -> torch.Tensor:
    """Stack the metric sums of micro-batch outputs into one vector (what ranks all-reduce)."""
    scalars = torch.stack(
        [
            torch.stack([o.weighted_ce, o.weight_sum, o.accept_sum, o.accept_tf_sum, o.accept_blocks]).float()
            for o in outputs
        ]
    ).sum(dim=0)  # [5]
    correct = torch.stack([o.correct for o in outputs]).sum(dim=0)  # [P]
    count = torch.stack([o.count for o in outputs]).sum(dim=0)  # [P]
    return torch.cat([scalars, correct, count])


def metrics_from_vector(vector: torch.Tensor) -> dict[str, float]:
    """``loss``, ``acc_j`` (per predicted slot j), ``accept_len`` and ``accept_len_tf`` from `metric_vector` sums."""
    values = vector.double().cpu().tolist()
    weighted_ce, weight_sum, accept_sum, accept_tf_sum, blocks = values[:5]
    num_predicted = (len(values) - 5) // 2
    correct, count = values[5 : 5 + num_predicted], values[5 + num_predicted :]
    summary = {"loss": weighted_ce / weight_sum if weight_sum else math.nan}
    for j in range(num_predicted):
        summary[f"acc_{j + 1}"] = correct[j] / count[j] if count[j] else math.nan
    summary["accept_len"] = accept_sum / blocks if blocks else math.nan
    summary["accept_len_tf"] = accept_tf_sum / blocks if blocks else math.nan
    return summary


def summarize_metrics(outputs: list[ObjectiveOutput]) -> dict[str, float]:
    """Aggregate micro-batch outputs into ``loss``, ``acc_j``, ``accept_len``, ``accept_len_tf`` (one process)."""
    return metrics_from_vector(metric_vector(outputs))
