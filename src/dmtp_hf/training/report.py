"""What a training run tells the person running it: the progress bar's summary of a step, held-out metrics on one
line, and the lines the run ends with (`run_summary`: steps and time, the checkpoints written and how to load
them, the final evaluation)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["duration", "metrics_text", "progress_postfix", "run_summary"]


def duration(seconds: float) -> str:
    """``42.0s``, ``12m05s`` or ``3h07m``: a run's wall time as people read it."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def metrics_text(metrics: Mapping[str, Any]) -> str:
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


def progress_postfix(metrics: Mapping[str, float]) -> dict[str, str]:
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


def run_summary(
    *,
    steps: int,
    processes: int,
    seconds: float,
    sessions: int,
    session_steps: int,
    session_seconds: float,
    exported: Mapping[str, Path],
    config: TrainConfig,
    draft_layout: str | None,
    last_eval: Mapping[str, Any] | None,
) -> str:
    """What a run did, in a few lines: ``steps`` and ``seconds`` of the whole run (``sessions`` resumed ones
    included; this session's ``session_steps`` in ``session_seconds``), the ``exported`` checkpoint(s) and how to use
    them (a draft of ``draft_layout`` with a T1 slot names the head it was trained with, when not the target's own),
    and the last held-out evaluation (when one ran)."""
    head = f"trained {steps} steps on {processes} process(es) in {duration(seconds)}"
    if sessions > 1:
        done = f"steps {steps - session_steps + 1}-{steps}" if session_steps else "no steps left"
        head += f" ({sessions} sessions; this one: {done} in {duration(session_seconds)})"
    lines = [head]
    if "draft" in exported:
        path = exported["draft"]
        head_arg = ""
        with_head = "mtp_head" in exported or config.mtp_init_from or config.mtp_retrofit
        if with_head and draft_layout != "dflash":
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
    if last_eval is not None:
        lines.append(f"final eval (step {last_eval.get('step')}): {metrics_text(last_eval)}")
    return "\n".join(lines)
