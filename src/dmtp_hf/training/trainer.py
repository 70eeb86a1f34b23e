"""The trainer: one loop for DMTP (single/dual layouts), the DFlash baseline and the native MTP head.

``accelerate launch scripts/finetune.py --config configs/example-dmtp.yaml`` (or plain ``python``) runs `main`.
The rooms around it: `config.TrainConfig` (every setting, validated), `models` (what is trained: the draft, the
head, the `protocol.TrainingObjective` around them), `data` (the datasets), `schedule.StepSchedule` (which samples
each process reads), `checkpoints.Checkpointer` (atomic checkpoints, resume, export), `report` (what the run
prints). Read `Trainer.__init__` (the setup), then `Trainer.train` and `Trainer.train_step` top to bottom: frozen
target + MTP head (features online, or read from offline shards), AdamW, cosine schedule with warmup, gradient
clipping, bf16 autocast on GPU, gradient accumulation, optional gradient checkpointing and LoRA, periodic held-out
evaluation, TensorBoard.

The loss of a step is ``sum(w * CE) / sum(w)`` over the *whole global batch*: the weight total is known before any
forward (it depends on anchors and loss masks only: `TrainingObjective.loss_normalizers`), so each micro-batch's
loss is normalised by the global total (times the number of processes, which DDP averages over).
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..assistant.target.loading import freeze, load_target
from ..modeling import DMTPDraftModel
from .arguments import train_parser
from .checkpoints import Checkpointer, weights_only_checkpoint
from .config import TrainConfig
from .data import collate, data_fingerprints, training_datasets
from .features import FeatureExtractor, teacher_labels
from .interruptions import GracefulStop, TrainingInterrupted, terminal_interrupts_to_this_process
from .models import build_mtp_head, build_objective, fill_draft_vocabulary, fill_head_vocabulary, trained_draft
from .objective import anchor_scores, plan_blocks
from .protocol import TrainingObjective
from .report import progress_postfix, run_summary
from .schedule import StepSchedule, eval_batches, rewarm_factor

__all__ = ["StepCallback", "Trainer", "main"]


StepCallback = Callable[["Trainer", int, dict[str, float]], None]


class Trainer:
    """Trains a DMTP (or DFlash) draft and/or the native MTP head against a frozen target.

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
        self.accelerator = accelerator or build_accelerator(config)
        acc = self.accelerator
        set_seed(config.seed)  # the initial draft weights (from scratch) are the same on every process

        # The frozen target (its embedding and LM head included), the native MTP head (frozen unless trained) and the
        # draft (bound to the target: embedding and LM head are the target's, never copied; None: the head alone).
        if target is None:
            auto_dtype = "bfloat16" if torch.cuda.is_available() else "float32"
            dtype = config.target_dtype if config.target_dtype != "auto" else auto_dtype
            target = load_target(config.target_model, dtype=getattr(torch, dtype))
        self.target = freeze(target).to(acc.device)
        self.mtp_head = build_mtp_head(config, self.target)
        draft = trained_draft(config, self.target, self.mtp_head)

        # The data, the vocabularies drawn from it (drafts and heads from scratch) and which samples each step reads.
        self.train_dataset, self.eval_dataset = training_datasets(config, self.target, train_dataset, eval_dataset)
        verbose = acc.is_main_process
        self.draft_vocab_stats = fill_draft_vocabulary(config, draft, self.train_dataset, self.target, verbose)
        self.head_vocab_stats = fill_head_vocabulary(config, self.mtp_head, self.train_dataset, self.target, verbose)
        self.schedule = StepSchedule(
            len(self.train_dataset),
            config.micro_batch_size,
            config.gradient_accumulation_steps,
            acc.num_processes,
            acc.process_index,
            config.seed,
        )
        self.total_steps = config.max_steps or config.num_epochs * self.schedule.steps_per_epoch

        # What is trained, and the frozen features it reads: the frozen head's outputs, or the inputs of a trained one.
        objective = build_objective(config, draft, self.mtp_head)
        trains_head = objective.trained_head is not None
        self.extractor = FeatureExtractor(
            self.target,
            objective.draft.config.target_layer_ids if objective.draft is not None else [],
            None if trains_head else self.mtp_head,
            hidden_input=config.mtp_hidden_input,
            head_inputs=trains_head,
            final_hidden=trains_head and config.mtp_kl_weight > 0,
            target_labels=config.labels == "target",
        )

        # Optimisation. The scheduler is stepped by hand once per optimizer step (accelerate would step it once per
        # process), and registered so that save_state/load_state carry it.
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

        # Checkpoints (the data files' fingerprints are checked on resume) and the counters they carry.
        fingerprints = data_fingerprints(config.train_data) if train_dataset is None else {}
        self.checkpointer = Checkpointer(config, acc, self.target, self.mtp_head, fingerprints)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.train_seconds = 0.0  # wall time of all runs so far (checkpointed, so resumed runs add up)
        self.sessions = 1  # runs of the command that trained these weights, this one included (checkpointed)
        self.last_eval: dict[str, float] | None = None
        self.rewarm_from: int | None = None  # the step a weights-only checkpoint resumed at (fresh AdamW moments)
        self._checked_frozen = False

    # ------------------------------------------------------------------------------------------------------------
    # What is trained

    @property
    def unwrapped_objective(self) -> TrainingObjective:
        """The objective module without accelerate's wrapper (DDP/FSDP)."""
        return self.accelerator.unwrap_model(self.objective)

    @property
    def draft(self) -> DMTPDraftModel:
        """The plain draft being trained (LoRA layers injected when ``lora`` is on)."""
        draft = self.unwrapped_objective.draft
        if draft is None:
            raise AttributeError("train_mtp_head='only' trains no draft")
        return draft

    @property
    def trained_head(self) -> nn.Module | None:
        """The MTP head being trained (LoRA-wrapped when ``lora`` is on in ``only`` mode); None when frozen."""
        return self.unwrapped_objective.trained_head

    def frozen_parameters(self) -> dict[str, torch.Tensor]:
        """Every frozen parameter: the target's (embedding and LM head included), and the MTP head's unless trained."""
        params = {f"target.{n}": p for n, p in self.target.named_parameters()}
        if self.mtp_head is not None and self.trained_head is None:
            params.update({f"mtp.{n}": p for n, p in self.mtp_head.named_parameters()})
        return params

    # ------------------------------------------------------------------------------------------------------------
    # Batches

    def _sample(self, dataset: torch.utils.data.Dataset, i: int) -> dict[str, torch.Tensor]:
        return {k: v[: self.config.max_length] for k, v in dataset[i].items()}

    def _prepare_micro_batch(self, samples: list[dict[str, torch.Tensor]], scores: torch.Tensor) -> dict[str, Any]:
        """Collate, compute (or read) the frozen features and plan the blocks of one micro-batch."""
        device = self.accelerator.device
        objective = self.unwrapped_objective
        batch = {k: v.to(device) for k, v in collate(samples).items()}
        trains_head = objective.trained_head is not None
        features = self.extractor.batch_features(batch, trains_head=trains_head, has_head=self.mtp_head is not None)
        inputs = {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"], **features}
        if objective.draft is not None:
            inputs["plan"] = plan = plan_blocks(
                batch["input_ids"],
                batch["loss_mask"],
                scores.to(device),
                objective.draft.config,
                self.config.num_anchors,
                self.config.loss_decay_gamma,
                label_ids=teacher_labels(batch["input_ids"], features.get("target_next")),
            )
            if not trains_head and self.mtp_head is not None and "mtp_hidden" not in features:
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

        At the end the main process prints what the run did (`report.run_summary`): steps and wall time of the whole
        run, sessions it resumed from included, where the final checkpoint is, and the final held-out metrics
        (evaluated at the last step when evaluation is on)."""
        acc, config = self.accelerator, self.config
        resume = self.checkpointer.resume_point()
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
        final = Path(config.output_dir) / "final"
        exported = self.checkpointer.export(self.objective, self.step, final, self.training_record())
        if acc.is_main_process:
            draft = self.unwrapped_objective.draft
            summary = run_summary(
                steps=self.step,
                processes=acc.num_processes,
                seconds=self.train_seconds,
                sessions=self.sessions,
                session_steps=self.step - first_step,
                session_seconds=self.train_seconds - earlier_seconds,
                exported=exported,
                config=config,
                draft_layout=None if draft is None else draft.config.anchor_layout,
                last_eval=self.last_eval,
            )
            print(summary)
        self.end_run()
        return self.history

    def _loop(self, callbacks: Sequence[StepCallback], bar, stop: GracefulStop, start: float) -> None:
        """Steps up to ``total_steps``: log, evaluate, checkpoint; on SIGINT/SIGTERM save and stop."""
        acc, config = self.accelerator, self.config
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.step += 1
            metrics["step"] = self.step
            self.history.append(metrics)
            bar.update(1)
            bar.set_postfix(progress_postfix(metrics))
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
        objective = self.unwrapped_objective
        inputs = self._step_inputs(self.step)
        # Global normalisers (known before any forward): each loss term's weight total over every micro-batch of
        # every process, times the number of processes, which DDP averages over.
        local = [objective.loss_normalizers(x) for x in inputs]
        names = list(local[0])
        summed = torch.stack([torch.stack([weights[name] for name in names]) for weights in local]).sum(dim=0)
        totals = acc.reduce(summed.detach().clone(), reduction="sum").clamp(min=1e-6) / acc.num_processes
        normalizers = dict(zip(names, totals, strict=True))

        self.objective.train()
        outputs = []
        for i, batch in enumerate(inputs):
            last = i == len(inputs) - 1
            sync = contextlib.nullcontext() if last else acc.no_sync(self.objective)
            with sync:
                out = self.objective(**batch, **normalizers)
                acc.backward(out.loss)
            outputs.append(out)
        self._check_frozen()
        grad_norm = acc.clip_grad_norm_(self.objective.parameters(), config.max_grad_norm)
        factor = rewarm_factor(self.step, self.rewarm_from, config.rewarm_steps)
        if factor is not None:  # after a weights-only resume: the scheduled rate ramped up again
            for group, scheduled in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = scheduled * factor
        applied_lr = self.optimizer.param_groups[0]["lr"]  # what this step used (the scheduler then moves on)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

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
    # Checkpoints and records

    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of the current step (`Checkpointer.save`; all processes call this)."""
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "train_seconds": self.train_seconds,
            "sessions": self.sessions,
            "last_eval": self.last_eval,
            "rewarm_from": self.rewarm_from,
        }
        return self.checkpointer.save(self.objective, state)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Continue from a checkpoint (`Checkpointer.load`): its weights, optimizer, schedule and RNG, its step, and
        the time and sessions that led to it (this one added)."""
        state = self.checkpointer.load(directory, self.unwrapped_objective, self.scheduler)
        self.step = int(state["step"])
        self.rewarm_from = state.get("rewarm_from")
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.sessions = int(state.get("sessions", 1)) + 1  # the sessions that wrote the checkpoint, and this one
        self.last_eval = state.get("last_eval")

    def end_run(self) -> None:
        """End the run on every process together (after the last checkpoint or export): a barrier; then the DDP
        wrapper, whose reducer holds the gloo/NCCL group, is freed while every peer is still alive; then the group
        goes. Left to the interpreter's exit, that destructor ran after a peer had already left and could block for
        good (a two-process CPU run hung so about once in 180). The trainer keeps the unwrapped objective."""
        acc = self.accelerator
        acc.wait_for_everyone()
        self.objective = acc.unwrap_model(self.objective)
        acc.free_memory()  # accelerate's own references to the wrapper
        gc.collect()
        acc.end_training()  # trackers finish; the process group is destroyed

    def _evaluate_and_keep(self) -> dict[str, float]:
        self.last_eval = {"step": self.step, **self.evaluate()}
        return self.last_eval

    def training_record(self) -> dict[str, Any]:
        """What produced the current weights (written as ``training.json`` next to exported checkpoints)."""
        config = self.config
        draft = self.unwrapped_objective.draft
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
            "anchor_layout": None if draft is None else draft.config.anchor_layout,
            "fusion": None if draft is None else draft.config.fusion,
            "trainable_parameters": sum(p.numel() for p in self.objective.parameters() if p.requires_grad),
            "draft_vocabulary": self.draft_vocab_stats,  # coverage of the training answers (from scratch)
            "mtp_draft_vocabulary": self.head_vocab_stats,
            "last_eval": self.last_eval,
            "config": config.to_dict(),
        }


def build_accelerator(config: TrainConfig) -> Accelerator:
    """The run's `Accelerator`: bf16 autocast on GPU unless ``mixed_precision`` says otherwise, TensorBoard when
    ``report_to`` asks for it, CPU processes (gloo DDP) on a host without CUDA."""
    cuda = torch.cuda.is_available()
    precision = config.mixed_precision if config.mixed_precision != "auto" else ("bf16" if cuda else "no")
    return Accelerator(
        cpu=not cuda,  # on CPU-only hosts this is what turns a multi-process launch into gloo DDP (MULTI_CPU)
        mixed_precision=precision,
        log_with="tensorboard" if config.report_to == "tensorboard" else None,
        project_dir=config.output_dir,
    )


# ----------------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``dmtp train`` / ``scripts/finetune.py``: train a draft from a YAML config (``--set key=value`` overrides)."""
    args = train_parser().parse_args(argv)
    config = TrainConfig.from_yaml(args.config, args.set)
    config.check_model_paths()
    if args.snapshot:
        print(weights_only_checkpoint(config.output_dir, args.snapshot))
        return 0
    with terminal_interrupts_to_this_process():
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
