"""What the trainer trains and saves: the draft and the MTP head, built, LoRA-wrapped, merged and written once.

- `build_draft`: a draft from scratch (sized from the target) or from a DFlash/DMTP checkpoint (``init_from``); a
  DFlash checkpoint loaded as ``dual`` + ``residual`` starts exactly as "DFlash conditioned on T1" (zero fusion).
- `build_mtp_head`: the target's native head (frozen, or trainable), a tuned one (``mtp_init_from``) or a new
  retrofitted one.
- `trained_draft`, `build_objective`: the draft as the trainer trains it, and the `TrainingObjective` that trains
  it and/or the head: the one place ``train_mtp_head`` picks what is trained.
- `fill_draft_vocabulary`, `fill_head_vocabulary`: a new draft vocabulary from the training answers' tokens.
- `merged_copy` and `save_models`: plain checkpoints (LoRA merged into a copy) for periodic checkpoints and exports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from torch import nn

from ..assistant.target.loading import freeze
from ..modeling import DMTPConfig, DMTPDraftModel, load_native_mtp
from ..modeling.binding import target_identity
from ..modeling.configuration_dmtp import DEFAULT_NUM_CANDIDATES
from ..modeling.draft_vocab import frequency_ranked_vocabulary, set_draft_vocabulary
from ..modeling.native_mtp import NativeMTPHead, new_mtp_head
from ..modeling.native_mtp.export import save_mtp_head
from ..modeling.references import deepcopy_sharing
from .config import TrainConfig
from .mtp_objective import JointObjective, MTPHeadObjective
from .objective import DMTPTrainingObjective
from .protocol import TrainingObjective, unwrap_peft

__all__ = [
    "build_draft",
    "build_mtp_head",
    "build_objective",
    "fill_draft_vocabulary",
    "fill_head_vocabulary",
    "merged_copy",
    "save_models",
    "trained_draft",
    "wrap_lora",
]


def build_draft(config: TrainConfig, target: nn.Module, native_mtp: nn.Module | None = None) -> DMTPDraftModel:
    """The draft to train, bound to ``target`` (and ``native_mtp``): loaded from ``init_from`` or built from scratch.

    From scratch, the backbone copies the target's width, heads and head size (DFlash convention); everything can be
    overridden in ``draft_config`` (``mask_token_id`` is required: the target embedding row used for MASK slots).
    Either way the config records the target's identity (`binding.target_identity`), so that binding the trained
    draft to another target warns.
    """
    layout = {"anchor_layout": config.anchor_layout, "fusion": config.fusion}
    if config.init_from:
        # `draft_config.dflash_config` adds to the checkpoint's (e.g. DFlash2 keys on DFlash weights), never replaces
        overrides = dict(config.draft_config)
        extra = overrides.pop("dflash_config", None) or {}
        draft_config = DMTPConfig.from_pretrained(config.init_from, **layout, **overrides)
        if draft_config.loaded_from_dflash and "num_candidates" not in overrides:
            # The recipe's block (T1..T7), whatever the DFlash checkpoint's own block size (decoding follows that)
            draft_config.num_candidates = DEFAULT_NUM_CANDIDATES
        draft_config.dflash_config.update(extra)
        # the target it is trained for now (set before binding: no warning that init_from was for another one)
        draft_config.dmtp_config["target_identity"] = target_identity(target)
        draft_config.validate_dmtp()
        draft = DMTPDraftModel.from_pretrained(config.init_from, config=draft_config)
        return draft.bind(target, native_mtp=native_mtp)
    text = target.config.get_text_config()
    rope = dict(getattr(text, "rope_parameters", None) or {})
    kwargs: dict[str, Any] = {
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "rms_norm_eps": text.rms_norm_eps,
        "max_position_embeddings": text.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 1e6))},
        "num_target_layers": text.num_hidden_layers,
        "mtp_hidden_size": text.hidden_size,
        "mtp_hidden_input": config.mtp_hidden_input,
        **layout,
    }
    if config.mtp_retrofit:  # provenance: the draft says which head it needs when it is missing
        kwargs["dmtp_config"] = {"mtp_source": "retrofit"}
    kwargs.update(config.draft_config)
    if kwargs.get("mask_token_id") is None:
        raise ValueError("A draft built from scratch needs draft_config.mask_token_id (the MASK embedding row).")
    draft_config = DMTPConfig(**kwargs)
    draft_config.dmtp_config["target_identity"] = target_identity(target)  # binding elsewhere warns if it differs
    return DMTPDraftModel(draft_config).bind(target, native_mtp=native_mtp)


def build_mtp_head(config: TrainConfig, target: nn.Module) -> NativeMTPHead | None:
    """The native MTP head: frozen (draft training), trainable (``train_mtp_head`` only/joint), or None (DFlash)."""
    if config.train_mtp_head == "frozen" and config.anchor_layout == "dflash":
        return None
    trained = config.train_mtp_head != "frozen"
    dtype = torch.float32 if trained else None  # trained weights keep fp32 masters (autocast computes in bf16)
    if config.mtp_retrofit and not config.mtp_init_from:
        head = new_mtp_head(target, hidden_input=config.mtp_hidden_input, dtype=dtype)
    else:
        head = load_native_mtp(
            target, checkpoint=config.mtp_init_from, hidden_input=config.mtp_hidden_input, dtype=dtype
        )
    return head.requires_grad_(True).train() if trained else freeze(head)


def trained_draft(config: TrainConfig, target: nn.Module, native_mtp: nn.Module | None) -> nn.Module | None:
    """The draft as the trainer trains it (None when ``train_mtp_head`` is ``only``): `build_draft` from the run's
    seed, fp32 master weights, the configured attention kernel, activation checkpointing and LoRA."""
    if config.train_mtp_head == "only":
        return None
    set_seed(config.seed)
    draft = build_draft(config, target, native_mtp=native_mtp)
    # fp32 master weights whatever the target's dtype (binding cast the draft to it): AdamW on bf16 weights loses
    # small updates; autocast (mixed_precision) computes in bf16, the export is cast back to the target's dtype.
    draft.float()
    draft.set_attn_implementation(config.attn_implementation)
    if config.gradient_checkpointing:
        draft.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return wrap_lora(config, draft, ["fusion"] if draft.fusion is not None else None) if config.lora else draft


def build_objective(config: TrainConfig, draft: nn.Module | None, head: NativeMTPHead | None) -> TrainingObjective:
    """What the trainer trains, by ``train_mtp_head``: the draft's objective (``frozen``), the head's (``only``,
    LoRA-wrapped when ``lora`` is on) or both (``joint``). Everything after asks the objective, not the mode."""
    if config.train_mtp_head == "only":
        head = wrap_lora(config, head, None) if config.lora else head
        return MTPHeadObjective(head, config.mtp_kl_weight, config.logits_chunk_size or 1024)
    objective = DMTPTrainingObjective(
        draft, config.loss_decay_gamma, config.logits_chunk_size, config.selector_loss_weight
    )
    if config.train_mtp_head == "joint":
        head_objective = MTPHeadObjective(head, config.mtp_kl_weight, config.logits_chunk_size or 1024)
        return JointObjective(objective, head_objective, config.mtp_loss_weight)
    return objective


def fill_draft_vocabulary(
    config: TrainConfig,
    draft: nn.Module | None,
    dataset: Iterable[dict[str, torch.Tensor]],
    target: nn.Module,
    verbose: bool = True,
) -> dict[str, float] | None:
    """A draft vocabulary from scratch (``draft_config.draft_vocab_size``): the training answers' most frequent
    target tokens, EOS always in (`frequency_ranked_fill`); the draft of a checkpoint (``init_from``) keeps its own.
    Returns the coverage statistics of a new one."""
    model = unwrap_peft(draft)
    if model is None or getattr(model, "d2t", None) is None or config.init_from:
        return None
    return frequency_ranked_fill(model, dataset, target, "draft vocabulary", verbose)


def fill_head_vocabulary(
    config: TrainConfig,
    head: NativeMTPHead | None,
    dataset: Iterable[dict[str, torch.Tensor]],
    target: nn.Module,
    verbose: bool = True,
) -> dict[str, float] | None:
    """The trained head's draft vocabulary (``mtp_draft_vocab_size``), built as the draft's; a head continued from a
    checkpoint with one keeps it (refused when its size differs)."""
    size = config.mtp_draft_vocab_size
    if size is None or head is None:
        return None
    if head.d2t is not None:
        if head.d2t.numel() != size:
            raise ValueError(
                f"mtp_draft_vocab_size={size}, but the head from {config.mtp_init_from} has a draft vocabulary of "
                f"{head.d2t.numel()} tokens"
            )
        return None
    head.use_draft_vocabulary(size)
    head.to(head.projection.weight.device)
    return frequency_ranked_fill(head, dataset, target, "MTP head vocabulary", verbose)


def frequency_ranked_fill(
    model: nn.Module, dataset: Iterable[dict[str, torch.Tensor]], target: nn.Module, what: str, verbose: bool = True
) -> dict[str, float]:
    """Fill ``model``'s draft vocabulary with the most frequent target tokens of the dataset's answers (its
    ``loss_mask``), EOS always in; says so (``verbose``) and returns the coverage statistics."""
    answers = (item["input_ids"][item["loss_mask"].bool()].tolist() for item in dataset)
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    ids, stats = frequency_ranked_vocabulary(answers, model.d2t.numel(), model.t2d.numel(), always)
    set_draft_vocabulary(model, ids)
    if verbose:
        print(
            f"{what}: {len(ids)} of {model.t2d.numel()} tokens, {stats['coverage']:.1%} of the training answers' tokens"
        )
    return stats


def wrap_lora(config: TrainConfig, model: nn.Module, modules_to_save: list[str] | None) -> nn.Module:
    """``model`` with PEFT LoRA adapters on ``lora_target_modules`` (``modules_to_save`` stay fully trainable)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        modules_to_save=modules_to_save,
    )
    return get_peft_model(model, lora)


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain model from a (possibly PEFT/LoRA-wrapped) draft or head; LoRA is merged into a *copy*.

    The original keeps training unchanged (merging in place and unmerging would not round-trip bit-exactly). The copy
    shares the target: drafts and heads reference it and copies keep referencing it (``references.py``).
    """
    if not hasattr(model, "merge_and_unload"):
        return model
    return deepcopy_sharing(model).merge_and_unload()


def save_models(
    draft: nn.Module | None,
    head: nn.Module | None,
    target: nn.Module,
    *,
    draft_dir: str | os.PathLike | None,
    head_dir: str | os.PathLike | None,
    step: int,
    draft_state_dict: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the trained draft (a plain `DMTPDraftModel` checkpoint) and the trained MTP head (the target's own names,
    ``load_native_mtp(target, checkpoint=head_dir)``), LoRA merged. ``draft_state_dict``: the draft's weights as
    gathered from sharded training (FSDP/DeepSpeed); ``None`` = the module's own. ``dtype``: the draft's weights
    cast to it (the final export is in the target's dtype; training keeps fp32 masters)."""
    if draft is not None:
        if hasattr(draft, "merge_and_unload") or draft_state_dict is None:
            draft, draft_state_dict = merged_copy(draft), None
        weights = draft_state_dict if draft_state_dict is not None else draft.state_dict()
        if dtype is not None:
            weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        draft.save_pretrained(draft_dir, state_dict=weights)
        if dtype is not None:  # save_pretrained records the module's own (fp32 master) dtype
            config_file = Path(draft_dir) / "config.json"
            config = json.loads(config_file.read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if head is not None:
        head_dir = Path(head_dir)
        save_mtp_head(merged_copy(head), head_dir / "head", target, training_steps=step)
        for item in (head_dir / "head").iterdir():  # the head's files directly in head_dir
            os.replace(item, head_dir / item.name)
        (head_dir / "head").rmdir()
