"""The draft trainer: one loop for DMTP (single/dual layouts) and the DFlash baseline.

``accelerate launch scripts/finetune.py --config configs/example-dmtp.yaml`` (or plain ``python``) runs `main`.

Read top to bottom:

1. `TrainConfig`: every setting, typed, loaded from YAML (unknown keys are errors).
2. `build_draft`: a draft from scratch (sized from the target) or from a DFlash/DMTP checkpoint (``init_from``); a
   DFlash checkpoint loaded as ``dual`` + ``residual`` starts exactly as "DFlash conditioned on T1" (zero fusion).
3. `StepSchedule`: which samples each process reads at each optimizer step, a pure function of ``(seed, step)``.
   Anchors are also drawn per *global* batch from ``(seed, step)`` (`objective.anchor_scores`). Hence exact resume
   (no data-loader state to restore) and a 2-process run equal to a 1-process run with the same global batch.
4. `Trainer`: frozen target + MTP head (features online, or read from offline shards), AdamW, cosine schedule with
   warmup, gradient clipping, bf16 autocast on GPU, gradient accumulation, optional gradient checkpointing and LoRA,
   atomic checkpoints (accelerate state + an exportable draft), periodic held-out evaluation, TensorBoard.

The loss of a step is ``sum(w * CE) / sum(w)`` over the *whole global batch*: the weight total is known before any
forward (it depends on anchors and loss masks only), so each micro-batch's loss is normalised by the global total
(times the number of processes, which DDP averages over).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationConfig, HfArgumentParser, get_cosine_schedule_with_warmup

from ..bundled import resolve_target_path
from ..modeling import DMTPConfig, DMTPDraftModel, load_native_mtp
from ..modeling.io import atomic_directory
from ..modeling.native_mtp import NativeMTPHead, new_mtp_head
from ..modeling.native_mtp.export import save_mtp_head
from .data import TokenizedDataset, collate, load_dataset_records
from .features import FEATURE_KEYS, FeatureExtractor, freeze, load_target
from .mtp_objective import JointObjective, MTPHeadObjective, mtp_positions
from .objective import DMTPTrainingObjective, anchor_scores, plan_blocks

__all__ = [
    "StepSchedule",
    "TrainConfig",
    "Trainer",
    "build_draft",
    "main",
    "merged_draft",
    "synthetic_greedy_dataset",
]

LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------------------------------
# 1. Config


@dataclass(kw_only=True)
class TrainConfig:
    """Every training setting. Load with `TrainConfig.from_yaml`; see ``configs/*.yaml`` for documented examples."""

    # --- models
    target_model: str  # target checkpoint (``bundled``: the bundled target)
    init_from: str | None = None  # DFlash or DMTP draft checkpoint to continue from; None = from scratch
    anchor_layout: str = "dual"  # dflash | single | dual
    fusion: str = "residual"  # none | hidden_residual | residual | replace (dflash forces none)
    draft_config: dict[str, Any] = field(default_factory=dict)  # DMTPConfig overrides (from scratch: sizes, mask id)
    attn_implementation: str = "sdpa"  # sdpa (dense mask) | flex_attention (BlockMask) | eager
    mtp_hidden_input: str = "post_norm"  # which target hidden the MTP head reads
    train_mtp_head: str = "frozen"  # frozen (train the draft) | only (the native MTP head alone) | joint (both)
    mtp_init_from: str | None = None  # head checkpoint (`save_mtp_head`) to start from; None = the target's own
    mtp_retrofit: bool = False  # the target ships no MTP head: train a new one (retrofit layout)
    mtp_loss_weight: float = 1.0  # joint: weight of the head loss next to the draft loss
    mtp_kl_weight: float = 0.0  # head loss: CE + this * KL(target || head)
    target_dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    # --- data
    train_data: str  # chat/pre-tokenized JSONL, an offline feature directory, or synthetic:<N>x<len>
    eval_data: str | None = None  # held-out set (same forms); None = the last `eval_holdout` train samples
    eval_holdout: int = 0
    tokenizer: str | None = None  # default: the target checkpoint
    enable_thinking: bool | None = None  # chat template `enable_thinking` (None: template default)
    mask_strategy: str = "auto"  # auto | generation | incremental (see training/data.py)
    max_length: int = 4096
    # --- objective
    num_anchors: int = 512
    loss_decay_gamma: float | None = 4.0  # exp(-(j-1)/gamma) slot weights; 4 for 8-slot blocks (SpecForge)
    logits_chunk_size: int | None = None  # supervised slots per LM-head chunk (checkpointed); None = all at once
    # --- optimisation
    micro_batch_size: int = 1  # per process
    gradient_accumulation_steps: int = 1
    num_epochs: int = 1
    max_steps: int | None = None  # overrides num_epochs
    learning_rate: float = 6e-4
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"  # auto (bf16 on GPU) | no | bf16 | fp16
    gradient_checkpointing: bool = False
    seed: int = 42
    # --- LoRA (PEFT) on the backbone; the fusion stays fully trainable
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    # --- checkpoints, evaluation, logging
    output_dir: str
    save_every: int = 1000  # steps; 0 = only at the end
    save_total_limit: int | None = 3
    resume_from: str | None = "auto"  # auto (latest in output_dir) | a checkpoint directory | None
    eval_every: int = 500  # steps; 0 = never
    eval_batch_size: int = 4
    log_every: int = 10
    report_to: str = "tensorboard"  # tensorboard | none

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build and type-check from a plain dict (unknown keys raise ``ValueError`` naming them)."""
        try:
            (config,) = HfArgumentParser(cls).parse_dict(values, allow_extra_keys=False)
        except ValueError as err:
            raise ValueError(f"Unknown config key(s): {err}") from None
        # HfArgumentParser.parse_dict does not check value types: a wrong type must fail here, not mid-training.
        hints = typing.get_type_hints(cls)
        for key, value in values.items():
            if not _type_matches(value, hints[key]):
                raise ValueError(f"Config key {key!r} expects {hints[key]}, got {value!r}")
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
        """Load a YAML file, then apply ``key=value`` overrides (values parsed as YAML)."""
        values = yaml.safe_load(Path(path).read_text()) or {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"Override {item!r} is not of the form key=value")
            values[key.strip()] = yaml.safe_load(raw)
        return cls.from_dict(values)

    def validate(self) -> None:
        """Raise ``ValueError`` on inconsistent settings."""
        choices = {
            "anchor_layout": ("dflash", "single", "dual"),
            "attn_implementation": ("sdpa", "flex_attention", "eager"),
            "mixed_precision": ("auto", "no", "bf16", "fp16"),
            "report_to": ("tensorboard", "none"),
            "mask_strategy": ("auto", "generation", "incremental"),
            "train_mtp_head": ("frozen", "only", "joint"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        for key in ("micro_batch_size", "gradient_accumulation_steps", "num_anchors", "max_length", "num_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")
        if self.logits_chunk_size is not None and self.logits_chunk_size < 1:
            raise ValueError("logits_chunk_size must be >= 1 (or null for no chunking)")
        if self.anchor_layout == "dflash" and self.fusion != "none":
            self.fusion = "none"  # DFlash blocks have no T1 slot
        if self.train_mtp_head == "joint" and self.anchor_layout == "dflash":
            raise ValueError("train_mtp_head='joint' trains a DMTP draft with the head: anchor_layout 'single'/'dual'")
        if self.mtp_retrofit and self.train_mtp_head == "frozen" and not self.mtp_init_from:
            raise ValueError("mtp_retrofit builds an untrained head: train it (train_mtp_head only/joint)")

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (what is saved next to checkpoints)."""
        return dataclasses.asdict(self)


def _type_matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return hint is Any or isinstance(value, hint)


# ----------------------------------------------------------------------------------------------------
# 2. Draft construction


def build_draft(config: TrainConfig, target: nn.Module) -> DMTPDraftModel:
    """The draft to train, bound to ``target``: loaded from ``init_from`` or built from scratch.

    From scratch, the backbone copies the target's width, heads and head size (DFlash convention); everything can be
    overridden in ``draft_config`` (``mask_token_id`` is required: the target embedding row used for MASK slots).
    """
    layout = {"anchor_layout": config.anchor_layout, "fusion": config.fusion}
    if config.init_from:
        draft = DMTPDraftModel.from_pretrained(config.init_from, **layout, **config.draft_config)
        return draft.bind(target)
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
    kwargs.update(config.draft_config)
    if kwargs.get("mask_token_id") is None:
        raise ValueError("A draft built from scratch needs draft_config.mask_token_id (the MASK embedding row).")
    return DMTPDraftModel(DMTPConfig(**kwargs)).bind(target)


def merged_draft(model: nn.Module) -> DMTPDraftModel:
    """A plain `DMTPDraftModel` from a (possibly PEFT/LoRA-wrapped) draft; LoRA is merged into a *copy*.

    The original keeps training unchanged (merging in place and unmerging would not round-trip bit-exactly).
    """
    if not hasattr(model, "merge_and_unload"):
        return model
    base = model.get_base_model()
    # The bound target lives in the draft's __dict__; keep it out of the deep copy.
    bound = {key: base.__dict__.get(key) for key in ("_target", "_native_mtp")}
    base.__dict__.update(dict.fromkeys(bound))
    try:
        clone = copy.deepcopy(model)
    finally:
        base.__dict__.update(bound)
    merged = clone.merge_and_unload()
    merged.__dict__.update(bound)
    return merged


def synthetic_greedy_dataset(
    target: nn.Module, num_samples: int, length: int, prompt_length: int = 8, seed: int = 0
) -> TokenizedDataset:
    """Random prompts continued greedily by the target itself (smoke tests: the target-regenerated data setting).

    Loss mask: the continuation only. ``train_data: synthetic:<N>x<len>`` in a config selects it.
    """
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    device = next(target.parameters()).device
    prompts = torch.randint(0, vocab - 1, (num_samples, prompt_length), generator=generator).to(device)
    # No EOS: every sample runs to `length` tokens.
    greedy = GenerationConfig(do_sample=False, max_new_tokens=length - prompt_length, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=greedy)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt_length:] = 1
    return TokenizedDataset([{"input_ids": i.cpu(), "loss_mask": m.cpu()} for i, m in zip(ids, loss_mask, strict=True)])


def merged_head(model: nn.Module) -> NativeMTPHead:
    """A plain `NativeMTPHead` from a (possibly LoRA-wrapped) head; LoRA is merged into a copy (see `merged_draft`)."""
    if not hasattr(model, "merge_and_unload"):
        return model
    base = model.get_base_model()
    shared = base.__dict__.pop("_shared")  # the target's embedding and LM head: referenced, never copied
    try:
        clone = copy.deepcopy(model)
    finally:
        base.__dict__["_shared"] = shared
    merged = clone.merge_and_unload()
    merged.__dict__["_shared"] = shared
    return merged


# ----------------------------------------------------------------------------------------------------
# 3. Which samples each process reads


class StepSchedule:
    """Deterministic data order: epoch ``e`` is a permutation seeded by ``seed + e``; step ``s`` takes the next
    ``global_batch_size`` samples (last partial batch dropped). Micro-batch ``m`` of process ``r`` reads global rows
    ``[(m * P + r) * b, ... + b)``, so any split of the same global batch reads the same samples in the same rows."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        accumulation_steps: int,
        num_processes: int = 1,
        process_index: int = 0,
        seed: int = 0,
    ):
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.accumulation_steps = accumulation_steps
        self.num_processes = num_processes
        self.process_index = process_index
        self.seed = seed
        self.global_batch_size = micro_batch_size * accumulation_steps * num_processes
        self.steps_per_epoch = num_samples // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"The training set has {num_samples} samples, fewer than one global batch ({self.global_batch_size} "
                f"= micro_batch_size x gradient_accumulation_steps x processes)."
            )
        self._epoch, self._order = -1, None

    def micro_batches(self, step: int) -> list[tuple[list[int], int]]:
        """This process's micro-batches at ``step``: ``(sample indices, first global row)`` each."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_samples, generator=generator).tolist()
        batch = self._order[k * self.global_batch_size : (k + 1) * self.global_batch_size]
        out = []
        for m in range(self.accumulation_steps):
            row = (m * self.num_processes + self.process_index) * self.micro_batch_size
            out.append((batch[row : row + self.micro_batch_size], row))
        return out


# ----------------------------------------------------------------------------------------------------
# 4. The trainer


StepCallback = Callable[["Trainer", int, dict[str, float]], None]


class Trainer:
    """Trains a DMTP (or DFlash) draft against a frozen target and its frozen native MTP head.

    Args:
        config: the `TrainConfig`.
        target: an already-loaded target (default: loaded from ``config.target_model``).
        train_dataset / eval_dataset: datasets of ``{"input_ids", "loss_mask"[, features]}`` samples (default: read
            from ``config.train_data`` / ``config.eval_data``).
        accelerator: an `accelerate.Accelerator` (default: built from the config).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        target: nn.Module | None = None,
        train_dataset: torch.utils.data.Dataset | None = None,
        eval_dataset: torch.utils.data.Dataset | None = None,
        accelerator: Accelerator | None = None,
    ):
        self.config = config
        cuda = torch.cuda.is_available()
        precision = config.mixed_precision if config.mixed_precision != "auto" else ("bf16" if cuda else "no")
        self.accelerator = accelerator or Accelerator(
            cpu=not cuda,  # on CPU-only hosts this is what turns a multi-process launch into gloo DDP (MULTI_CPU)
            mixed_precision=precision,
            log_with="tensorboard" if config.report_to == "tensorboard" else None,
            project_dir=config.output_dir,
        )
        acc = self.accelerator
        set_seed(config.seed)  # the initial draft weights (from scratch) are the same on every process

        # The frozen target (its embedding and LM head included), the native MTP head (frozen unless trained) and the
        # draft (bound to the target: embedding and LM head are the target's, never copied).
        if target is None:
            dtype = config.target_dtype if config.target_dtype != "auto" else ("bfloat16" if cuda else "float32")
            target = load_target(config.target_model, dtype=getattr(torch, dtype))
        self.target = freeze(target).to(acc.device)
        self.mtp_head = self._build_mtp_head()
        draft = None if config.train_mtp_head == "only" else self._build_draft()
        frozen_head = self.mtp_head if config.train_mtp_head == "frozen" else None
        self.extractor = FeatureExtractor(
            self.target,
            draft.config.target_layer_ids if draft is not None else [],
            frozen_head,
            hidden_input=config.mtp_hidden_input,
            head_inputs=config.train_mtp_head != "frozen",
            final_hidden=config.train_mtp_head != "frozen" and config.mtp_kl_weight > 0,
        )

        # Data.
        self.train_dataset = train_dataset if train_dataset is not None else self._load_data(config.train_data)
        self.eval_dataset = eval_dataset
        if eval_dataset is None and config.eval_data:
            self.eval_dataset = self._load_data(config.eval_data)
        elif eval_dataset is None and config.eval_holdout > 0:
            n = len(self.train_dataset)
            keep = n - config.eval_holdout
            self.eval_dataset = torch.utils.data.Subset(self.train_dataset, range(keep, n))
            self.train_dataset = torch.utils.data.Subset(self.train_dataset, range(keep))
        self.schedule = StepSchedule(
            len(self.train_dataset),
            config.micro_batch_size,
            config.gradient_accumulation_steps,
            acc.num_processes,
            acc.process_index,
            config.seed,
        )
        self.total_steps = config.max_steps or config.num_epochs * self.schedule.steps_per_epoch

        # Optimisation. The scheduler is stepped by hand once per optimizer step (accelerate would step it once per
        # process), and registered so that save_state/load_state carry it.
        objective = self._build_objective(draft)
        trainable = [p for p in objective.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable,
            lr=config.learning_rate,
            betas=tuple(config.adam_betas),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.objective, self.optimizer = acc.prepare(objective, optimizer)
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, math.ceil(config.warmup_ratio * self.total_steps), self.total_steps
        )
        acc.register_for_checkpointing(self.scheduler)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.train_seconds = 0.0  # wall time of all runs so far (checkpointed, so resumed runs add up)
        self.last_eval: dict[str, float] | None = None
        self._checked_frozen = False

    # ------------------------------------------------------------------------------------------------------------
    # Setup helpers

    def _build_mtp_head(self) -> NativeMTPHead | None:
        """The native MTP head: frozen (draft training), trainable (``train_mtp_head`` only/joint), or None (DFlash)."""
        config = self.config
        if config.train_mtp_head == "frozen" and config.anchor_layout == "dflash":
            return None
        trained = config.train_mtp_head != "frozen"
        dtype = torch.float32 if trained else None  # trained weights keep fp32 masters (autocast computes in bf16)
        if config.mtp_retrofit and not config.mtp_init_from:
            head = new_mtp_head(self.target, hidden_input=config.mtp_hidden_input, dtype=dtype)
        else:
            head = load_native_mtp(
                self.target, checkpoint=config.mtp_init_from, hidden_input=config.mtp_hidden_input, dtype=dtype
            )
        return head.requires_grad_(True).train() if trained else freeze(head)

    def _build_draft(self) -> nn.Module:
        config = self.config
        set_seed(config.seed)
        draft = build_draft(config, self.target)
        draft.set_attn_implementation(config.attn_implementation)
        draft.bind(self.target, native_mtp=self.mtp_head)
        if config.gradient_checkpointing:
            draft.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return self._wrap_lora(draft, ["fusion"] if draft.fusion is not None else None) if config.lora else draft

    def _build_objective(self, draft: nn.Module | None) -> nn.Module:
        """What accelerate wraps: the draft objective, the head objective (``only``), or both (``joint``)."""
        config = self.config
        if config.train_mtp_head == "only":
            head = self._wrap_lora(self.mtp_head, None) if config.lora else self.mtp_head
            return MTPHeadObjective(head, config.mtp_kl_weight, config.logits_chunk_size or 1024)
        objective = DMTPTrainingObjective(draft, config.loss_decay_gamma, config.logits_chunk_size)
        if config.train_mtp_head == "joint":
            head = MTPHeadObjective(self.mtp_head, config.mtp_kl_weight, config.logits_chunk_size or 1024)
            objective = JointObjective(objective, head, config.mtp_loss_weight)
        return objective

    def _wrap_lora(self, model: nn.Module, modules_to_save: list[str] | None) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        config = self.config
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.lora_target_modules),
            modules_to_save=modules_to_save,
        )
        return get_peft_model(model, lora)

    def _load_data(self, source: str) -> torch.utils.data.Dataset:
        config = self.config
        if source.startswith("synthetic:"):
            num, _, length = source.removeprefix("synthetic:").partition("x")
            return synthetic_greedy_dataset(self.target, int(num), int(length), seed=config.seed)
        tokenizer = config.tokenizer or resolve_target_path(config.target_model)
        return load_dataset_records(
            source,
            tokenizer=tokenizer,
            max_length=config.max_length,
            enable_thinking=config.enable_thinking,
            mask_strategy=config.mask_strategy,
        )

    @property
    def unwrapped_objective(self) -> nn.Module:
        """The objective module without accelerate's wrapper (DDP/FSDP)."""
        return self.accelerator.unwrap_model(self.objective)

    @property
    def draft(self) -> DMTPDraftModel:
        """The plain draft being trained (LoRA layers injected when ``lora`` is on)."""
        if self.config.train_mtp_head == "only":
            raise AttributeError("train_mtp_head='only' trains no draft")
        return self.unwrapped_objective.draft

    @property
    def trained_head(self) -> nn.Module | None:
        """The MTP head being trained (LoRA-wrapped when ``lora`` is on in ``only`` mode); None when frozen."""
        objective = self.unwrapped_objective
        if isinstance(objective, JointObjective):
            return objective.head_objective.model
        return objective.model if isinstance(objective, MTPHeadObjective) else None

    def frozen_parameters(self) -> dict[str, torch.Tensor]:
        """Every frozen parameter: the target's (embedding and LM head included), and the MTP head's unless trained."""
        params = {f"target.{n}": p for n, p in self.target.named_parameters()}
        if self.mtp_head is not None and self.config.train_mtp_head == "frozen":
            params.update({f"mtp.{n}": p for n, p in self.mtp_head.named_parameters()})
        return params

    # ------------------------------------------------------------------------------------------------------------
    # Batches

    def _sample(self, dataset: torch.utils.data.Dataset, i: int) -> dict[str, torch.Tensor]:
        return {k: v[: self.config.max_length] for k, v in dataset[i].items()}

    def _prepare_micro_batch(self, samples: list[dict[str, torch.Tensor]], scores: torch.Tensor) -> dict[str, Any]:
        """Collate, compute (or read) the frozen features and plan the blocks of one micro-batch."""
        device = self.accelerator.device
        batch = {k: v.to(device) for k, v in collate(samples).items()}
        if "context" in batch or "head_hidden" in batch:  # offline features
            features = {k: batch[k] for k in FEATURE_KEYS if k in batch}
            needs_head_inputs = self.config.train_mtp_head != "frozen" or (
                self.mtp_head is not None and "mtp_hidden" not in features
            )
            if needs_head_inputs and "head_hidden" not in features:
                raise ValueError("These offline features hold no MTP head inputs: extract them with --head-inputs")
            if self.config.train_mtp_head == "frozen" and self.mtp_head is not None and "mtp_hidden" not in features:
                features.update(self.extractor.mtp_features(batch["input_ids"], features["head_hidden"]))
        else:
            features = self.extractor(batch["input_ids"], batch["attention_mask"])
        inputs = {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"], **features}
        if self.config.train_mtp_head != "only":
            inputs["plan"] = plan_blocks(
                batch["input_ids"],
                batch["loss_mask"],
                scores.to(device),
                self.draft.config,
                self.config.num_anchors,
                self.config.loss_decay_gamma,
            )
        return inputs

    def _step_inputs(self, step: int) -> list[dict[str, Any]]:
        scores = anchor_scores(self.config.seed, step, self.schedule.global_batch_size, self.config.max_length)
        inputs = []
        for indices, row in self.schedule.micro_batches(step):
            samples = [self._sample(self.train_dataset, i) for i in indices]
            inputs.append(self._prepare_micro_batch(samples, scores[row : row + len(indices)]))
        return inputs

    # ------------------------------------------------------------------------------------------------------------
    # Training

    def train(self, callbacks: Sequence[StepCallback] = ()) -> list[dict[str, float]]:
        """Run (or resume) training up to ``total_steps``; returns the per-step metric history of this run."""
        acc, config = self.accelerator, self.config
        resume = self._find_resume_checkpoint()
        if resume is not None:
            self.load_checkpoint(resume)
        if config.report_to != "none":
            acc.init_trackers("dmtp", config={k: str(v) for k, v in config.to_dict().items()})
        if config.eval_every and self.eval_dataset is not None and self.step == 0:
            acc.log({f"eval/{k}": v for k, v in self._evaluate_and_keep().items()}, step=0)

        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", disable=not acc.is_main_process)
        start = run_start = time.perf_counter()
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.step += 1
            metrics.update(lr=self.scheduler.get_last_lr()[0], step=self.step)
            self.history.append(metrics)
            bar.update(1)
            bar.set_postfix(_postfix(metrics))
            if self.step % config.log_every == 0 or self.step == self.total_steps:
                acc.log({f"train/{k}": v for k, v in metrics.items() if k != "step"}, step=self.step)
            if config.eval_every and self.eval_dataset is not None and self.step % config.eval_every == 0:
                acc.log({f"eval/{k}": v for k, v in self._evaluate_and_keep().items()}, step=self.step)
            self.train_seconds += time.perf_counter() - start
            start = time.perf_counter()
            if config.save_every and self.step % config.save_every == 0:
                self.save_checkpoint()
            for callback in callbacks:
                callback(self, self.step, metrics)
        bar.close()
        if not config.save_every or self.step % config.save_every:
            self.save_checkpoint()
        self.export(Path(config.output_dir) / "final")
        if acc.is_main_process:
            elapsed = time.perf_counter() - run_start
            print(f"trained {self.total_steps} steps on {acc.num_processes} process(es) in {elapsed:.1f}s")
        acc.end_training()
        return self.history

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this process's micro-batches; returns metrics of the whole global batch."""
        acc, config = self.accelerator, self.config
        inputs = self._step_inputs(self.step)
        # Global normalisers (known before any forward): the draft's slot weights and the head's supervised positions
        # over every micro-batch of every process, times the number of processes, which DDP averages over.
        local = torch.stack(
            [
                torch.stack([x["plan"].weight_sum if "plan" in x else x["loss_mask"].new_zeros(()).float(),
                             mtp_positions(x["loss_mask"]).sum().float()])
                for x in inputs
            ]
        ).sum(dim=0)  # fmt: skip
        totals = acc.reduce(local.detach().clone(), reduction="sum").clamp(min=1e-6) / acc.num_processes
        normalizer, mtp_normalizer = totals[0], totals[1]

        self.objective.train()
        outputs: list = []
        for i, batch in enumerate(inputs):
            last = i == len(inputs) - 1
            sync = contextlib.nullcontext() if last else acc.no_sync(self.objective)
            with sync:
                out = self.objective(**batch, normalizer=normalizer, mtp_normalizer=mtp_normalizer)
                acc.backward(out[0].loss if isinstance(out, tuple) else out.loss)
            outputs.append(out)
        self._check_frozen()
        grad_norm = acc.clip_grad_norm_(self.objective.parameters(), config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        objective = self.unwrapped_objective
        metrics = objective.metrics_from_vector(acc.reduce(objective.metric_vector(outputs), reduction="sum"))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        return metrics

    def _check_frozen(self) -> None:
        """Once, after the first backward: no gradient may reach the target, its embedding/LM head or the MTP head."""
        if self._checked_frozen:
            return
        leaked = [n for n, p in self.frozen_parameters().items() if p.requires_grad or p.grad is not None]
        if leaked:
            raise RuntimeError(f"Gradient reached frozen parameters: {leaked[:10]}")
        self._checked_frozen = True

    @torch.no_grad()
    def evaluate(self, dataset: torch.utils.data.Dataset | None = None) -> dict[str, float]:
        """Loss, per-slot accuracy and simulated acceptance on held-out data (fixed anchors, all processes)."""
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("No evaluation dataset (set eval_data or eval_holdout).")
        acc, size = self.accelerator, self.config.eval_batch_size
        self.objective.eval()
        outputs = []
        batches = range(0, len(dataset), size)
        for b, start in enumerate(batches):
            if b % acc.num_processes != acc.process_index:
                continue
            indices = range(start, min(start + size, len(dataset)))
            samples = [self._sample(dataset, i) for i in indices]
            scores = anchor_scores(self.config.seed, -1 - b, len(samples), self.config.max_length)
            outputs.append(self.objective(**self._prepare_micro_batch(samples, scores)))
        objective = self.unwrapped_objective
        # A process without an eval batch contributes zeros of the right shape.
        vector = objective.metric_vector(outputs) if outputs else objective.empty_metric_vector(acc.device)
        self.objective.train()
        return objective.metrics_from_vector(acc.reduce(vector.to(acc.device), reduction="sum"))

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints

    @property
    def checkpoint_root(self) -> Path:
        """``output_dir/checkpoints``: one ``step-XXXXXXXX`` directory per checkpoint."""
        return Path(self.config.output_dir) / "checkpoints"

    # Our own naming and rotation, not accelerate's ProjectConfiguration(automatic_checkpoint_naming): that writes the
    # state in place (not atomically) and cannot keep the exported model and trainer state in the same unit.
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-N/{state/, model/, trainer_state.json}`` atomically (all processes call this).

        ``state/`` is accelerate's (model, optimizer, scheduler, RNG); ``model/`` is a plain `DMTPDraftModel`
        checkpoint (LoRA merged) loadable with ``DMTPDraftModel.from_pretrained``; ``mtp_head/`` the trained MTP head
        (``load_native_mtp(target, checkpoint=...)``) when the head is trained.
        """
        acc = self.accelerator
        final = self.checkpoint_root / f"step-{self.step:08d}"
        partial = self.checkpoint_root / f".step-{self.step:08d}.partial"
        if acc.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(partial))
        # Every process writes its own RNG state into `partial` and save_state does not wait for the others: moving
        # the folder before they are done made a slower process fail to write (a 2-process CPU run hit it).
        acc.wait_for_everyone()
        state_dict = acc.get_state_dict(self.objective)  # gathers sharded (FSDP/DeepSpeed) weights
        if acc.is_main_process:
            with atomic_directory(final) as tmp:
                os.replace(partial, tmp / "state")
                self._save_models(tmp / "model", tmp / "mtp_head", state_dict)
                state = {
                    "step": self.step,
                    "total_steps": self.total_steps,
                    "train_seconds": self.train_seconds,
                    "last_eval": self.last_eval,
                    "config": self.config.to_dict(),
                }
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
            self._prune_checkpoints()
        acc.wait_for_everyone()
        return final

    def _save_models(self, draft_dir: Path, head_dir: Path, state_dict: dict[str, torch.Tensor] | None) -> None:
        """The draft (when one is trained) and the MTP head (when it is trained), LoRA merged."""
        if self.config.train_mtp_head != "only":
            self._save_draft(draft_dir, state_dict)
        if self.trained_head is not None:
            save_mtp_head(merged_head(self.trained_head), head_dir, self.target, training_steps=self.step)

    def _save_draft(self, directory: Path, state_dict: dict[str, torch.Tensor] | None) -> None:
        objective = self.unwrapped_objective
        joint = isinstance(objective, JointObjective)
        unwrapped = (objective.draft_objective if joint else objective).model
        if hasattr(unwrapped, "merge_and_unload") or state_dict is None:
            merged_draft(unwrapped).save_pretrained(directory)
            return
        prefix = "draft_objective.model." if joint else "model."  # the gathered state dict (FSDP/DeepSpeed shards)
        weights = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        unwrapped.save_pretrained(directory, state_dict=weights)

    def _evaluate_and_keep(self) -> dict[str, float]:
        self.last_eval = {"step": self.step, **self.evaluate()}
        return self.last_eval

    def training_record(self) -> dict[str, Any]:
        """What produced the current weights (written as ``training.json`` next to exported checkpoints)."""
        config = self.config
        return {
            "steps": self.step,
            "num_processes": self.accelerator.num_processes,
            "micro_batch_size": config.micro_batch_size,
            "global_batch_size": self.schedule.global_batch_size,
            "train_samples": len(self.train_dataset),
            "train_seconds": self.train_seconds,
            "init_from": config.init_from,
            "train_mtp_head": config.train_mtp_head,
            "mtp_init_from": config.mtp_init_from,
            "anchor_layout": None if config.train_mtp_head == "only" else self.draft.config.anchor_layout,
            "fusion": None if config.train_mtp_head == "only" else self.draft.config.fusion,
            "trainable_parameters": sum(p.numel() for p in self.objective.parameters() if p.requires_grad),
            "last_eval": self.last_eval,
            "config": config.to_dict(),
        }

    def export(self, directory: str | os.PathLike, head_directory: str | os.PathLike | None = None) -> None:
        """Write what was trained, each atomically with a ``training.json``: the draft as a plain `DMTPDraftModel`
        checkpoint (LoRA merged) to ``directory``; the MTP head, when trained, to ``head_directory`` (default:
        ``<directory>_mtp_head``) as a head checkpoint ``load_native_mtp(target, checkpoint=...)`` reads."""
        state_dict = self.accelerator.get_state_dict(self.objective)
        if self.accelerator.is_main_process:
            record = json.dumps(self.training_record(), indent=2) + "\n"
            if self.config.train_mtp_head != "only":
                with atomic_directory(directory) as tmp:
                    self._save_draft(tmp, state_dict)
                    (tmp / "training.json").write_text(record)
            if self.trained_head is not None:
                head_directory = Path(head_directory or f"{directory}_mtp_head")
                with atomic_directory(head_directory) as tmp:
                    save_mtp_head(merged_head(self.trained_head), tmp / "head", self.target, training_steps=self.step)
                    for item in (tmp / "head").iterdir():
                        os.replace(item, tmp / item.name)
                    (tmp / "head").rmdir()
                    (tmp / "training.json").write_text(record)
        self.accelerator.wait_for_everyone()

    def _prune_checkpoints(self) -> None:
        limit = self.config.save_total_limit
        if not limit:
            return
        for old in sorted(self.checkpoint_root.glob("step-*"))[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _find_resume_checkpoint(self) -> Path | None:
        source = self.config.resume_from
        if not source:
            return None
        if source != "auto":
            return Path(source)
        found = sorted(self.checkpoint_root.glob("step-*"))
        return found[-1] if found else None

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Restore weights, optimizer, scheduler, RNG and step from a checkpoint written by `save_checkpoint`."""
        directory = Path(directory)
        state = json.loads((directory / "trainer_state.json").read_text())
        self.accelerator.load_state(str(directory / "state"))
        self.step = int(state["step"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.last_eval = state.get("last_eval")
        if self.accelerator.is_main_process:
            print(f"resumed from {directory} at step {self.step}")


def _postfix(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's summary of a step (draft and/or head metrics)."""
    shown = {}
    if "loss" in metrics:
        shown["loss"] = f"{metrics['loss']:.3f}"
        shown["acc"] = "/".join(f"{v:.2f}" for k, v in metrics.items() if k.startswith("acc_"))
        shown["tau_tf"] = f"{metrics['accept_len_tf']:.2f}"
    if "mtp_loss" in metrics:
        shown["mtp_loss"] = f"{metrics['mtp_loss']:.3f}"
        shown["mtp_acc"] = f"{metrics['mtp_acc']:.3f}"
    return shown


# ----------------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``dmtp train`` / ``scripts/finetune.py``: train a draft from a YAML config (``--set key=value`` overrides)."""
    parser = argparse.ArgumentParser(prog="dmtp train", description="Train a DMTP or DFlash draft.")
    parser.add_argument("--config", required=True, help="YAML training config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args(argv)
    config = TrainConfig.from_yaml(args.config, args.set)
    Trainer(config).train()
    return 0
