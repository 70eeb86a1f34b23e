"""Training DMTP drafts (and the DFlash baseline) against a frozen target and its frozen native MTP head.

- `data`: chat JSONL (OpenAI ``messages`` / ShareGPT ``conversations``) -> token ids + assistant loss mask.
- `regenerate`: rewrite the assistant turns with the target itself (``dmtp regenerate``).
- `features`: target context features and teacher-forced MTP hidden states, online or offline (``dmtp extract``).
- `protocol`: `TrainingObjective`, what the trainer asks of whatever it trains (what it trains and saves, its loss
  normalisers and metrics).
- `objective`: the draft's: anchors, blocks per layout, DFlash visibility masks (dense SDPA / FlexAttention),
  decayed CE, metrics; `mtp_objective`: the native MTP head's, and both together (joint).
- `config`: `TrainConfig`, every setting, validated (strict dataclass).
- `models`: the draft and MTP head to train (from scratch, DFlash/DMTP weights, retrofit), LoRA, the objective
  around them, saving.
- `schedule`: which samples each process reads at each step; `checkpoints`: `Checkpointer` (atomic checkpoints,
  resume, export); `report`: what a run prints.
- `trainer`: `Trainer`, the setup and the loop (accelerate; ``scripts/finetune.py``, ``dmtp train``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it. Loaded on first use (PEP 562): `dmtp train --help` imports
# `training.arguments` and `training.config` without torch, Accelerate or the trainer.
_LAZY = {
    "TrainConfig": "config",
    **dict.fromkeys(
        (
            "ChatRenderer",
            "TokenizedDataset",
            "collate",
            "conversation_from_record",
            "load_dataset_records",
            "read_jsonl",
            "synthetic_greedy_dataset",
        ),
        "data",
    ),
    **dict.fromkeys(("FeatureExtractor", "OfflineFeatureDataset", "extract_features", "load_target"), "features"),
    **dict.fromkeys(("build_draft", "merged_copy"), "models"),
    **dict.fromkeys(
        (
            "BlockPlan",
            "DMTPTrainingObjective",
            "ObjectiveOutput",
            "anchor_scores",
            "build_attention_masks",
            "plan_blocks",
            "sample_anchors",
            "summarize_metrics",
            "valid_anchor_mask",
        ),
        "objective",
    ),
    "TrainingObjective": "protocol",
    "regenerate": "regenerate",
    "StepSchedule": "schedule",
    "Trainer": "trainer",
}


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access (and keep the value here)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own names and the lazily loaded public ones."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BlockPlan",
    "ChatRenderer",
    "DMTPTrainingObjective",
    "FeatureExtractor",
    "ObjectiveOutput",
    "OfflineFeatureDataset",
    "StepSchedule",
    "TokenizedDataset",
    "TrainConfig",
    "Trainer",
    "TrainingObjective",
    "anchor_scores",
    "build_attention_masks",
    "build_draft",
    "collate",
    "conversation_from_record",
    "extract_features",
    "load_dataset_records",
    "load_target",
    "merged_copy",
    "plan_blocks",
    "read_jsonl",
    "regenerate",
    "sample_anchors",
    "summarize_metrics",
    "synthetic_greedy_dataset",
    "valid_anchor_mask",
]
