"""The trainer: one loop for DMTP (single/dual layouts), the DFlash baseline and the native MTP head.

``accelerate launch scripts/finetune.py --config configs/example-dmtp.yaml`` (or plain ``python``) runs `main`.
The rooms around it: `config.TrainConfig` (every setting, validated), `models` (what is trained and how it is
saved), `schedule.StepSchedule` (which samples each process reads), `checkpoints` (atomic checkpoints, resume,
export). Read `Trainer.train` and `Trainer.train_step` top to bottom: frozen target + MTP head (features online, or
read from offline shards), AdamW, cosine schedule with warmup, gradient clipping, bf16 autocast on GPU, gradient
accumulation, optional gradient checkpointing and LoRA, periodic held-out evaluation, TensorBoard.

The loss of a step is ``sum(w * CE) / sum(w)`` over the *whole global batch*: the weight total is known before any
forward (it depends on anchors and loss masks only), so each micro-batch's loss is normalised by the global total
(times the number of processes, which DDP averages over).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..bundled import resolve_target_path
from ..modeling import DMTPDraftModel
from ..modeling.draft_vocab import frequency_ranked_vocabulary, set_draft_vocabulary
from .checkpoints import CheckpointMixin, weights_only_checkpoint
from .config import TrainConfig
from .data import collate, load_dataset_records, mixed_dataset, parse_mix_item, synthetic_greedy_dataset
from .features import FeatureExtractor, freeze, load_target, teacher_labels
from .interruptions import GracefulStop, TrainingInterrupted
from .models import build_draft, build_mtp_head, wrap_lora
from .mtp_objective import JointObjective, MTPHeadObjective, mtp_positions
from .objective import DMTPTrainingObjective, anchor_scores, plan_blocks
from .schedule import StepSchedule, eval_batches

__all__ = ["StepCallback", "Trainer", "main"]


StepCallback = Callable[["Trainer", int, dict[str, float]], None]


class Trainer(CheckpointMixin):
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
        self.mtp_head = build_mtp_head(config, self.target)
        draft = None if config.train_mtp_head == "only" else self._build_draft()
        frozen_head = self.mtp_head if config.train_mtp_head == "frozen" else None
        self.extractor = FeatureExtractor(
            self.target,
            draft.config.target_layer_ids if draft is not None else [],
            frozen_head,
            hidden_input=config.mtp_hidden_input,
            head_inputs=config.train_mtp_head != "frozen",
            final_hidden=config.train_mtp_head != "frozen" and config.mtp_kl_weight > 0,
            target_labels=config.labels == "target",
        )

        self.train_dataset, self.eval_dataset = self._datasets(train_dataset, eval_dataset)
        self.data_fingerprints = self.fingerprint_data() if train_dataset is None else {}  # checked on resume
        self.draft_vocab_stats = self._fill_draft_vocabulary(draft) if draft is not None else None
        self.head_vocab_stats = self._head_vocabulary()
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
        self.sessions = 1  # runs of the command that trained these weights, this one included (checkpointed)
        self.last_eval: dict[str, float] | None = None
        self.rewarm_from: int | None = None  # the step a weights-only checkpoint resumed at (`_load_weights_only`)
        self._checked_frozen = False

    # ------------------------------------------------------------------------------------------------------------
    # Setup helpers

    def _datasets(self, train_dataset, eval_dataset):
        """The training and held-out sets: given, read from the config's files, or a held-out split of the training
        file (a seeded random subset: files are often grouped by source, and their tail is no held-out sample)."""
        config = self.config
        train = train_dataset if train_dataset is not None else self._load_data(config.train_data)
        if eval_dataset is not None or not (config.eval_data or config.eval_holdout > 0):
            return train, eval_dataset
        if config.eval_data:
            return train, self._load_data(config.eval_data)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.seed))
        held, kept = sorted(order[: config.eval_holdout].tolist()), sorted(order[config.eval_holdout :].tolist())
        return torch.utils.data.Subset(train, kept), torch.utils.data.Subset(train, held)

    def _build_draft(self) -> nn.Module:
        config = self.config
        set_seed(config.seed)
        draft = build_draft(config, self.target, native_mtp=self.mtp_head)
        # fp32 master weights whatever the target's dtype (binding cast the draft to it): AdamW on bf16 weights loses
        # small updates; autocast (mixed_precision) computes in bf16, the export is cast back to the target's dtype.
        draft.float()
        draft.set_attn_implementation(config.attn_implementation)
        if config.gradient_checkpointing:
            draft.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return wrap_lora(config, draft, ["fusion"] if draft.fusion is not None else None) if config.lora else draft

    def _fill_draft_vocabulary(self, draft: nn.Module) -> dict[str, float] | None:
        """A draft vocabulary from scratch (``draft_config.draft_vocab_size``): the training answers' most frequent
        target tokens, EOS always in. A draft continued from a checkpoint keeps the checkpoint's."""
        model = draft.get_base_model() if hasattr(draft, "get_base_model") else draft
        if getattr(model, "d2t", None) is None or self.config.init_from:
            return None
        return self._frequency_ranked(model, "draft vocabulary")

    def _head_vocabulary(self) -> dict[str, float] | None:
        """The trained head's draft vocabulary (``mtp_draft_vocab_size``), built as the draft's; a head continued
        from a checkpoint with one keeps it."""
        size, head = self.config.mtp_draft_vocab_size, self.mtp_head
        if size is None or head is None:
            return None
        if head.d2t is not None:
            if head.d2t.numel() != size:
                raise ValueError(
                    f"mtp_draft_vocab_size={size}, but the head from {self.config.mtp_init_from} has a draft "
                    f"vocabulary of {head.d2t.numel()} tokens"
                )
            return None
        head.use_draft_vocabulary(size)
        head.to(head.projection.weight.device)
        return self._frequency_ranked(head, "MTP head vocabulary")

    def _frequency_ranked(self, model: nn.Module, what: str) -> dict[str, float]:
        """Fill ``model``'s draft vocabulary with the training answers' most frequent target tokens, EOS always in."""
        answers = (item["input_ids"][item["loss_mask"].bool()].tolist() for item in self.train_dataset)
        eos = self.target.generation_config.eos_token_id
        always = [eos] if isinstance(eos, int) else list(eos or [])
        ids, stats = frequency_ranked_vocabulary(answers, model.d2t.numel(), model.t2d.numel(), always)
        set_draft_vocabulary(model, ids)
        if self.accelerator.is_main_process:
            print(
                f"{what}: {len(ids)} of {model.t2d.numel()} tokens, {stats['coverage']:.1%} of the training "
                f"answers' tokens"
            )
        return stats

    def _build_objective(self, draft: nn.Module | None) -> nn.Module:
        """What accelerate wraps: the draft objective, the head objective (``only``), or both (``joint``)."""
        config = self.config
        if config.train_mtp_head == "only":
            head = wrap_lora(config, self.mtp_head, None) if config.lora else self.mtp_head
            return MTPHeadObjective(head, config.mtp_kl_weight, config.logits_chunk_size or 1024)
        objective = DMTPTrainingObjective(
            draft, config.loss_decay_gamma, config.logits_chunk_size, config.selector_loss_weight
        )
        if config.train_mtp_head == "joint":
            head = MTPHeadObjective(self.mtp_head, config.mtp_kl_weight, config.logits_chunk_size or 1024)
            objective = JointObjective(objective, head, config.mtp_loss_weight)
        return objective

    def _load_data(self, source: str | list[str]) -> torch.utils.data.Dataset:
        if isinstance(source, list):
            parts = [(self._load_data(path), weight) for path, weight in map(parse_mix_item, source)]
            return mixed_dataset(parts, seed=self.config.seed)
        config = self.config
        if source.startswith("synthetic:"):
            num, _, length = source.removeprefix("synthetic:").partition("x")
            return synthetic_greedy_dataset(self.target, int(num), int(length), seed=config.seed)
        if not Path(source).exists():
            raise FileNotFoundError(
                f"The training data {source} does not exist; the comment next to it in the shipped configs names the "
                "command that makes it (e.g. scripts/reproduce/regenerate_bundled.sh)."
            )
        tokenizer = config.tokenizer or resolve_target_path(config.target_model)
        return load_dataset_records(
            source,
            tokenizer=tokenizer,
            max_length=config.max_length,
            enable_thinking=config.enable_thinking,
            mask_strategy=config.mask_strategy,
            vocab_size=self.target.config.get_text_config().vocab_size,
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
        trains_head = self.config.train_mtp_head != "frozen"
        features = self.extractor.batch_features(batch, trains_head=trains_head, has_head=self.mtp_head is not None)
        inputs = {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"], **features}
        if self.config.train_mtp_head != "only":
            inputs["plan"] = plan = plan_blocks(
                batch["input_ids"],
                batch["loss_mask"],
                scores.to(device),
                self.draft.config,
                self.config.num_anchors,
                self.config.loss_decay_gamma,
                label_ids=teacher_labels(batch["input_ids"], features.get("target_next")),
            )
            if self.config.train_mtp_head == "frozen" and self.mtp_head is not None and "mtp_hidden" not in features:
                # offline features without the head's outputs: the frozen head runs here, its guess only at anchors
                inputs.update(
                    self.extractor.mtp_features(
                        batch["input_ids"], features["head_hidden"], token_positions=(plan.anchors - 1).clamp(min=0)
                    )
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
        """Run (or resume) training up to ``total_steps``; returns the per-step metric history of this run.

        At the end the main process prints what the run did (`summary`): steps and wall time of the whole run,
        sessions it resumed from included, where the final checkpoint is, and the final held-out metrics (evaluated
        at the last step when evaluation is on)."""
        acc, config = self.accelerator, self.config
        resume = self._find_resume_checkpoint()
        if resume is not None:
            self.load_checkpoint(resume)
        first_step, earlier_seconds = self.step, self.train_seconds
        if config.report_to != "none":
            acc.init_trackers("dmtp", config={k: str(v) for k, v in config.to_dict().items()})
        evaluates = bool(config.eval_every) and self.eval_dataset is not None
        if evaluates and self.step == 0:
            acc.log({f"eval/{k}": v for k, v in self._evaluate_and_keep().items()}, step=0)

        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", disable=not acc.is_main_process)
        with GracefulStop() as stop:
            self._loop(callbacks, bar, stop, time.perf_counter())
        bar.close()
        if evaluates and (self.last_eval or {}).get("step") != self.step:  # the final weights' metrics, not older ones
            start = time.perf_counter()
            acc.log({f"eval/{k}": v for k, v in self._evaluate_and_keep().items()}, step=self.step)
            self.train_seconds += time.perf_counter() - start
        if not config.save_every or self.step % config.save_every:
            self.save_checkpoint()
        exported = self.export(Path(config.output_dir) / "final")
        if acc.is_main_process:
            print(self.summary(exported, self.step - first_step, self.train_seconds - earlier_seconds))
        self.end_run()
        return self.history

    def summary(self, exported: dict[str, Path], session_steps: int, session_seconds: float) -> str:
        """What the run did, in a few lines: steps and time of the whole run (earlier sessions included), the
        exported checkpoint(s) and how to use them, and the last held-out evaluation (when one ran)."""
        acc, config = self.accelerator, self.config
        head = f"trained {self.step} steps on {acc.num_processes} process(es) in {_duration(self.train_seconds)}"
        if self.sessions > 1:
            done = f"steps {self.step - session_steps + 1}-{self.step}" if session_steps else "no steps left"
            head += f" ({self.sessions} sessions; this one: {done} in {_duration(session_seconds)})"
        lines = [head]
        if "draft" in exported:
            path = exported["draft"]
            head_arg = ""  # a draft with a T1 slot decodes with the head it was trained with: say which
            with_head = "mtp_head" in exported or config.mtp_init_from or config.mtp_retrofit
            if with_head and self.draft.config.anchor_layout != "dflash":
                head_dir = "<final MTP head>" if "mtp_head" in exported else repr(config.mtp_init_from or "HEAD_DIR")
                head_arg = f", native_mtp=load_native_mtp(target, checkpoint={head_dir})"
            lines.append(
                f"final checkpoint: {path} (DMTPDraftModel.from_pretrained(path, target=target{head_arg}) loads it, "
                f"`dmtp push {path} ORG/NAME` uploads it)"
            )
        if "mtp_head" in exported:
            path = exported["mtp_head"]
            lines.append(
                f"final MTP head: {path} (load_native_mtp(target, checkpoint=path) loads it; eval/bench: --mtp-head)"
            )
        if self.last_eval is not None:
            lines.append(f"final eval (step {self.last_eval.get('step')}): {_metrics_text(self.last_eval)}")
        return "\n".join(lines)

    def _loop(self, callbacks: Sequence[StepCallback], bar, stop: GracefulStop, start: float) -> None:
        """Steps up to ``total_steps``: log, evaluate, checkpoint; on SIGINT/SIGTERM save and stop."""
        acc, config = self.accelerator, self.config
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.step += 1
            metrics["step"] = self.step
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
            if (name := stop.requested(acc)) is not None:
                bar.close()
                saved = self.save_checkpoint()
                self.end_run()
                raise TrainingInterrupted(name, self.step, saved)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this process's micro-batches; returns metrics of the whole global batch."""
        acc, config = self.accelerator, self.config
        inputs = self._step_inputs(self.step)
        # Global normalisers (known before any forward): the draft's slot weights and the head's supervised positions
        # over every micro-batch of every process, times the number of processes, which DDP averages over.
        per_micro_batch = []
        for x in inputs:
            draft_weight = x["plan"].weight_sum if "plan" in x else x["loss_mask"].new_zeros(()).float()
            per_micro_batch.append(torch.stack([draft_weight, mtp_positions(x["loss_mask"]).sum().float()]))
        local = torch.stack(per_micro_batch).sum(dim=0)
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
        self._rewarm_learning_rate()
        applied_lr = self.optimizer.param_groups[0]["lr"]  # what this step used (the scheduler then moves on)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        objective = self.unwrapped_objective
        metrics = objective.metrics_from_vector(acc.reduce(objective.metric_vector(outputs), reduction="sum"))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        metrics["lr"] = applied_lr
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
        num_batches = math.ceil(len(dataset) / size)
        for b, real in eval_batches(num_batches, acc.num_processes, acc.process_index):
            indices = range(b * size, min((b + 1) * size, len(dataset)))
            samples = [self._sample(dataset, i) for i in indices]
            scores = anchor_scores(self.config.seed, -1 - b, len(samples), self.config.max_length)
            out = self.objective(**self._prepare_micro_batch(samples, scores))
            if real:
                outputs.append(out)
        objective = self.unwrapped_objective
        # A process without an eval batch contributes zeros of the right shape.
        vector = objective.metric_vector(outputs) if outputs else objective.empty_metric_vector(acc.device)
        self.objective.train()
        return objective.metrics_from_vector(acc.reduce(vector.to(acc.device), reduction="sum"))

    # ------------------------------------------------------------------------------------------------------------
    # Records

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
            "sessions": self.sessions,
            "init_from": config.init_from,
            "train_mtp_head": config.train_mtp_head,
            "mtp_init_from": config.mtp_init_from,
            "anchor_layout": None if config.train_mtp_head == "only" else self.draft.config.anchor_layout,
            "fusion": None if config.train_mtp_head == "only" else self.draft.config.fusion,
            "trainable_parameters": sum(p.numel() for p in self.objective.parameters() if p.requires_grad),
            "draft_vocabulary": self.draft_vocab_stats,  # coverage of the training answers (from scratch)
            "mtp_draft_vocabulary": self.head_vocab_stats,
            "last_eval": self.last_eval,
            "config": config.to_dict(),
        }


def _duration(seconds: float) -> str:
    """``42.0s``, ``12m05s`` or ``3h07m``: a run's wall time as people read it."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def _metrics_text(metrics: dict[str, Any]) -> str:
    """Held-out metrics on one line: the draft's loss, per-slot accuracy and simulated acceptance length (real T1,
    then teacher-forced), and the head's loss and first-candidate accuracy."""
    parts = []
    if "loss" in metrics:
        accuracy = "/".join(f"{v:.2f}" for k, v in metrics.items() if k.startswith("acc_"))
        parts += [
            f"loss {metrics['loss']:.4f}",
            f"acc {accuracy}",
            f"accept_len {metrics['accept_len']:.2f}",
            f"accept_len_tf {metrics['accept_len_tf']:.2f}",
        ]
    if "mtp_loss" in metrics:
        parts += [f"mtp_loss {metrics['mtp_loss']:.4f}", f"mtp_acc {metrics['mtp_acc']:.3f}"]
    return ", ".join(parts)


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
    parser.add_argument(
        "--snapshot",
        metavar="DIR",
        help=(
            "do not train: copy the run's newest checkpoint to DIR/step-N, weights in bfloat16 and no optimizer "
            "state (small enough to commit; the run resumes from it, see docs/scaling.md)"
        ),
    )
    args = parser.parse_args(argv)
    config = TrainConfig.from_yaml(args.config, args.set)
    if args.snapshot:
        print(weights_only_checkpoint(config.output_dir, args.snapshot))
        return 0
    with _terminal_interrupts_to_this_process():
        trainer = Trainer(config)
        try:
            trainer.train()
        except TrainingInterrupted as stopped:
            if trainer.accelerator.is_main_process:  # one line, not one per process
                print(stopped, file=sys.stderr)
            # Ctrl-C asked for exactly this (saved, resumable): a success, so that `accelerate launch`, which raises
            # on a non-zero exit of its child, ends quietly too. A scheduler's SIGTERM stays a failure (143).
            return 0 if stopped.signal_name == "SIGINT" else stopped.exit_code
    return 0


# Set by accelerate's simple launcher (`accelerate launch --num_processes 1`, no torchrun) in its child's environment.
_SIMPLE_LAUNCHER_ENV = "ACCELERATE_USE_CPU"
# Set when the processes come from torchrun or MPI: several ranks, whose launcher forwards signals itself.
_MULTI_PROCESS_ENV = ("LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


@contextlib.contextmanager
def _terminal_interrupts_to_this_process() -> Iterator[None]:
    """Under ``accelerate launch`` with one process, in a terminal: Ctrl-C reaches this process only.

    A terminal sends Ctrl-C's SIGINT to its whole foreground process group, the launcher included. accelerate's
    simple launcher waits for its child in ``Popen.wait`` under Python's default handler: it raised
    ``KeyboardInterrupt`` at once (a traceback, exit status 130) while this process was still saving its checkpoint,
    and no launch flag changes that. So, as a shell does for a job, this process moves to a process group of its own
    and makes it the terminal's foreground group for the run; Ctrl-C then stops training alone (checkpoint saved,
    exit 0), and the launcher, still waiting, exits 0 without a word. The terminal goes back to the launcher's group
    on the way out (if this process dies first, the shell takes it back when the launcher ends). Ctrl-Z is ignored
    meanwhile: it would stop this group only, which the shell does not watch, leaving the terminal to a stopped job.
    Anywhere else (no terminal, a background job, torchrun or MPI ranks, plain ``python``) nothing changes.
    """
    terminal = 0  # stdin: the launcher's child inherits it
    applies = (
        _SIMPLE_LAUNCHER_ENV in os.environ
        and not any(name in os.environ for name in _MULTI_PROCESS_ENV)
        and hasattr(os, "tcsetpgrp")  # POSIX job control
        and threading.current_thread() is threading.main_thread()  # signal handlers
    )
    try:
        launcher_group = os.getpgrp() if applies else None
        applies = applies and (
            os.isatty(terminal)
            and os.tcgetpgrp(terminal) == launcher_group  # a foreground job
            and os.getpgid(os.getppid()) == launcher_group  # the launcher shares the group (and would get Ctrl-C)
            and launcher_group != os.getpid()
        )
    except OSError:
        applies = False
    if not applies:
        yield
        return
    previous_stop = signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)
        _give_terminal_to(terminal, os.getpgrp())
    except OSError:  # left as it was: Ctrl-C reaches both, as without this
        with contextlib.suppress(OSError):
            os.setpgid(0, launcher_group)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            _give_terminal_to(terminal, launcher_group)
            os.setpgid(0, launcher_group)
        signal.signal(signal.SIGTSTP, previous_stop)


def _give_terminal_to(terminal: int, group: int) -> None:
    """``tcsetpgrp`` from a process that may be in a background group (SIGTTOU would stop it: blocked meanwhile)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(terminal, group)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
