"""The trainer's checkpoints: `Checkpointer`, which the `Trainer` holds, writes atomic ``step-N`` directories
(accelerate state + plain exported models) and rotates them, finds and restores the one to resume from, and exports
the final models.

`weights_only_checkpoint` copies a checkpoint without its optimizer state, the weights cast to bfloat16: small enough
to commit, so that a run can span machines whose disks are not kept. The trainer resumes from such a copy too."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..modeling import DMTPDraftModel, load_native_mtp
from ..modeling.io import atomic_directory
from .models import save_models

if TYPE_CHECKING:
    from accelerate import Accelerator

    from .config import TrainConfig
    from .protocol import TrainingObjective

__all__ = [
    "HARMLESS_CHANGES",
    "Checkpointer",
    "check_data_fingerprints",
    "check_resumed_config",
    "latest_checkpoint",
    "remove_stale_writes",
    "weights_only_checkpoint",
]

logger = logging.getLogger(__name__)
# Settings a resumed run may change without changing the weights it produces (logging, checkpoints, evaluation, and
# the LM-head chunking, a memory/speed trade: tests/test_training.py trains the same weights either way).
HARMLESS_CHANGES = frozenset(
    {
        "log_every",
        "report_to",
        "eval_every",
        "eval_batch_size",
        "save_every",
        "save_total_limit",
        "resume_from",
        "output_dir",
        "allow_config_change",
        "logits_chunk_size",
    }
)


def check_resumed_config(saved: dict[str, Any], current: dict[str, Any], directory: Path) -> None:
    """Refuse to resume with settings that change what training computes (learning rate, batch, steps, data,
    model...) unless ``allow_config_change``; log the harmless changes."""
    changed = sorted(k for k in set(saved) | set(current) if k in saved and saved.get(k) != current.get(k))
    harmful = [k for k in changed if k not in HARMLESS_CHANGES]
    details = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
    if harmful and not current.get("allow_config_change"):
        raise ValueError(
            f"Resuming from {directory} with a different config ({details}): the result would not be the run the "
            f"checkpoint belongs to. Restore {harmful}, or pass --set allow_config_change=true to continue anyway."
        )
    if changed:
        logger.warning("Resuming from %s with changed settings: %s", directory, details)


def check_data_fingerprints(saved: dict[str, str], current: dict[str, str], directory: Path, allow: bool) -> None:
    """Refuse to resume when a data file the checkpoint was trained on changed since (the fingerprints the
    checkpoint stored differ from this run's), unless ``allow`` (``allow_config_change``): then log a warning.
    Paths only one side knows are the config's business (`check_resumed_config` compares ``train_data``)."""
    changed = sorted(path for path in saved.keys() & current.keys() if saved[path] != current[path])
    if not changed:
        return
    message = f"Resuming from {directory}, but the training data changed since that checkpoint was written: {changed}"
    if not allow:
        raise ValueError(
            f"{message}. The result would not be the run the checkpoint belongs to: restore the data, or pass "
            "--set allow_config_change=true to continue on the new data anyway."
        )
    logger.warning("%s; continuing on the new data (allow_config_change)", message)


# `atomic_directory` (modeling/io.py) writes `step-N` through a sibling `mkdtemp(prefix=".step-N.tmp-")`: an
# interrupted checkpoint write leaves that folder behind, as large as a checkpoint. Nothing else matches.
# `atomic_directory`'s temporary folders, and the accelerate state a save writes before moving it into one
_STALE_WRITE = re.compile(r"\.step-\d+\.(tmp-[A-Za-z0-9_]+|partial)")


def remove_stale_writes(root: str | os.PathLike) -> list[Path]:
    """Delete the temporary folders that interrupted checkpoint writes left in ``root`` (``.step-N.tmp-*``, the
    pattern of `atomic_directory`, and ``.step-N.partial``; checkpoints and any other file stay) and return them.
    Call it only while no checkpoint is being written into ``root``."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if _STALE_WRITE.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    if stale:
        logger.warning("Removed %d folder(s) of interrupted checkpoint writes: %s", len(stale), [str(p) for p in stale])
    return stale


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest ``step-N`` checkpoint in ``directory`` (a checkpoint root, or a run's ``output_dir``)."""
    directory = Path(directory)
    root = directory / "checkpoints" if (directory / "checkpoints").is_dir() else directory
    found = sorted(root.glob("step-*"))
    return found[-1] if found else None


def weights_only_checkpoint(
    checkpoint: str | os.PathLike, destination: str | os.PathLike, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Copy a `save_checkpoint` directory (or the newest one of a run's ``output_dir``) into
    ``destination/step-N``, atomically: ``model/`` and ``mtp_head/`` with floating weights cast to ``dtype``, and
    ``trainer_state.json``; no optimizer, scheduler or RNG state. A run resumed from it (`load_checkpoint`) keeps
    its step, schedule and data order and starts fresh AdamW moments."""
    source = Path(checkpoint)
    if not (source / "trainer_state.json").is_file():
        found = latest_checkpoint(source)
        if found is None:
            raise FileNotFoundError(f"{checkpoint} is neither a trainer checkpoint nor a run holding one")
        source = found
    final = Path(destination) / source.name
    with atomic_directory(final) as tmp:
        shutil.copy2(source / "trainer_state.json", tmp / "trainer_state.json")
        for part in ("model", "mtp_head"):
            if (source / part).is_dir():
                shutil.copytree(source / part, tmp / part)
                _cast_weights(tmp / part, dtype)
    return final


def _cast_weights(directory: Path, dtype: torch.dtype) -> None:
    """Cast every floating tensor of the ``*.safetensors`` files in ``directory`` to ``dtype``, and the configs'
    recorded dtype with them."""
    for file in directory.glob("*.safetensors"):
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(file).items()}
        save_file(weights, str(file), metadata={"format": "pt"})
    for file in directory.glob("*.json"):
        config = json.loads(file.read_text())
        if isinstance(config, dict) and ("dtype" in config or "torch_dtype" in config):
            config.update({k: str(dtype).removeprefix("torch.") for k in ("dtype", "torch_dtype") if k in config})
            file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class Checkpointer:
    """A run's checkpoints, held by the `Trainer`: ``output_dir/checkpoints/step-N`` directories written atomically
    and rotated (`save`), the one a run resumes from (`resume_point`) and its restoring (`load`), and the final
    models (`export`). What is saved is what the objective trains (`TrainingObjective.trained_modules`).

    Our own naming and rotation, not accelerate's ``ProjectConfiguration(automatic_checkpoint_naming)``: that writes
    the state in place (not atomically) and cannot keep the exported models and the trainer state in one unit.

    Args:
        config: the run's `TrainConfig` (saved with each checkpoint, compared on resume: `check_resumed_config`).
        accelerator: the run's `Accelerator`, whose state (objective, optimizer, scheduler, RNG) a checkpoint holds.
        target: the frozen target (a saved head's tensor names; a saved draft is bound to it on a weights-only
            resume).
        native_mtp: the run's MTP head, which a saved draft is bound with on a weights-only resume.
        data_fingerprints: the training data's (`data.data_fingerprints`), saved and compared on resume.
    """

    def __init__(
        self,
        config: TrainConfig,
        accelerator: Accelerator,
        target: nn.Module,
        native_mtp: nn.Module | None = None,
        data_fingerprints: dict[str, str] | None = None,
    ):
        self.config = config
        self.accelerator = accelerator
        self.target = target
        self.native_mtp = native_mtp
        self.data_fingerprints = dict(data_fingerprints or {})
        self.root = Path(config.output_dir) / "checkpoints"  # one step-XXXXXXXX directory per checkpoint

    def save(self, objective: nn.Module, state: dict[str, Any]) -> Path:
        """Write ``step-N/{state/, model/, mtp_head/, trainer_state.json}`` atomically (all processes call this).
        ``state/`` is accelerate's (objective, optimizer, scheduler, RNG); ``model/`` a plain `DMTPDraftModel`
        checkpoint (LoRA merged) and ``mtp_head/`` the head, when trained; ``trainer_state.json`` the trainer's
        counters ``state`` (``step`` among them), the config and the data fingerprints. ``objective``: as accelerate
        prepared it."""
        acc, step = self.accelerator, state["step"]
        final = self.root / f"step-{step:08d}"
        partial = self.root / f".step-{step:08d}.partial"
        if acc.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(partial))
        # Every process writes its own RNG state into `partial` and save_state does not wait for the others: moving
        # the folder before they are done made a slower process fail to write (a 2-process CPU run hit it).
        acc.wait_for_everyone()
        state_dict = acc.get_state_dict(objective)  # gathers sharded (FSDP/DeepSpeed) weights
        if acc.is_main_process:
            record = {**state, "config": self.config.to_dict(), "data_fingerprints": self.data_fingerprints}
            with atomic_directory(final) as tmp:
                os.replace(partial, tmp / "state")
                self._save_models(acc.unwrap_model(objective), step, state_dict, tmp / "model", tmp / "mtp_head")
                (tmp / "trainer_state.json").write_text(json.dumps(record, indent=2) + "\n")
            self._prune()
            remove_stale_writes(self.root)  # this write succeeded: any other temporary one is dead
        acc.wait_for_everyone()
        return final

    def export(
        self,
        objective: nn.Module,
        step: int,
        directory: str | os.PathLike,
        record: dict[str, Any],
        head_directory: str | os.PathLike | None = None,
    ) -> dict[str, Path]:
        """Write what was trained, each atomically with ``record`` as its ``training.json``: the draft as a plain
        `DMTPDraftModel` checkpoint (LoRA merged, in the target's dtype) to ``directory``; the MTP head, when trained,
        to ``head_directory`` (default: ``<directory>_mtp_head``) as a head checkpoint ``load_native_mtp(target,
        checkpoint=...)`` reads. Returns ``{"draft": ..., "mtp_head": ...}``, the folders written (on every
        process)."""
        state_dict = self.accelerator.get_state_dict(objective)
        plain = self.accelerator.unwrap_model(objective)
        parts = plain.trained_modules()
        written = {}
        if "draft" in parts:
            written["draft"] = Path(directory)
        if "mtp_head" in parts:
            written["mtp_head"] = Path(head_directory or f"{directory}_mtp_head")
        if self.accelerator.is_main_process:
            text = json.dumps(record, indent=2) + "\n"
            if "draft" in written:
                with atomic_directory(written["draft"]) as tmp:  # fp32 masters, exported in the target's dtype
                    dtype = self.target.get_input_embeddings().weight.dtype
                    self._save_models(plain, step, state_dict, tmp, None, dtype=dtype)
                    (tmp / "training.json").write_text(text)
            if "mtp_head" in written:
                with atomic_directory(written["mtp_head"]) as tmp:
                    self._save_models(plain, step, state_dict, None, tmp)
                    (tmp / "training.json").write_text(text)
        self.accelerator.wait_for_everyone()
        return written

    def _save_models(
        self,
        objective: TrainingObjective,
        step: int,
        state_dict: dict[str, torch.Tensor] | None,
        draft_dir: Path | None,
        head_dir: Path | None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """The draft (when trained) to ``draft_dir``, its weights taken from the gathered ``state_dict``, and the MTP
        head (when trained) to ``head_dir``."""
        parts = objective.trained_modules()
        draft = parts.get("draft") if draft_dir is not None else None
        weights = objective.part_weights("draft", state_dict) if draft is not None and state_dict is not None else None
        head = parts.get("mtp_head") if head_dir is not None else None
        save_models(
            draft,
            head,
            self.target,
            draft_dir=draft_dir,
            head_dir=head_dir,
            step=step,
            draft_state_dict=weights,
            dtype=dtype,
        )

    def _prune(self) -> None:
        limit = self.config.save_total_limit
        if not limit:
            return
        for old in sorted(self.root.glob("step-*"))[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def resume_point(self) -> Path | None:
        """The checkpoint this run resumes from (``resume_from``: the newest one for ``auto``), or None; the
        temporary folders of interrupted writes go first."""
        source = self.config.resume_from
        if not source:
            return None
        if self.accelerator.is_main_process:  # no checkpoint is being written before the run starts
            remove_stale_writes(self.root)
        if source != "auto":
            return Path(source)
        return latest_checkpoint(self.root)

    def load(
        self,
        directory: str | os.PathLike,
        objective: TrainingObjective,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler and RNG from a checkpoint written by `save`, after comparing its
        config and data with this run's (`check_resumed_config`, `check_data_fingerprints`); from a
        `weights_only_checkpoint`, the weights and the schedule (`_load_weights_only`: its ``rewarm_from`` is then
        the step). Returns the saved trainer counters. ``objective``: unwrapped (the plain module)."""
        directory = Path(directory)
        state = json.loads((directory / "trainer_state.json").read_text())
        check_resumed_config(state.get("config") or {}, self.config.to_dict(), directory)
        saved_data, allow = state.get("data_fingerprints") or {}, self.config.allow_config_change
        check_data_fingerprints(saved_data, self.data_fingerprints, directory, allow)
        step = int(state["step"])
        if (directory / "state").is_dir():
            self.accelerator.load_state(str(directory / "state"))
        else:
            self._load_weights_only(directory, objective, scheduler, step)
            state["rewarm_from"] = step
        if self.accelerator.is_main_process:
            print(f"resumed from {directory} at step {step}")
        return state

    def _load_weights_only(
        self,
        directory: Path,
        objective: TrainingObjective,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        step: int,
    ) -> None:
        """Resume from a `weights_only_checkpoint`: the draft and head weights (into the fp32 masters) and the
        learning-rate schedule at ``step``. The data order is a function of the step, so it continues exactly;
        AdamW's moments start from zero, so the learning rate ramps up again over ``rewarm_steps`` (a first update
        from one gradient's moments would be as large as the learning rate in every coordinate)."""
        if self.config.lora:
            raise ValueError(
                f"{directory} holds merged weights without the LoRA adapters: resume a LoRA run from a full checkpoint"
            )
        if objective.draft is not None:
            # bound with the run's head: a target without a native one (a retrofitted head) is refused otherwise
            saved = DMTPDraftModel.from_pretrained(directory / "model", target=self.target, native_mtp=self.native_mtp)
            objective.draft.load_state_dict(saved.state_dict())  # in place, into the fp32 masters
        if objective.trained_head is not None:
            saved_head = load_native_mtp(
                self.target,
                checkpoint=directory / "mtp_head",
                dtype=torch.float32,
                hidden_input=self.config.mtp_hidden_input,
            )
            objective.trained_head.load_state_dict(saved_head.state_dict())
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": no step is skipped, the schedule is set
            warnings.simplefilter("ignore")
            scheduler.step()
        if self.accelerator.is_main_process:
            print(
                f"{directory} holds no optimizer state: fresh AdamW moments, learning rate ramped up again over "
                f"{self.config.rewarm_steps} steps"
            )
