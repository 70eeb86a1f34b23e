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

from .config import TrainConfig
from .data import (
    ChatRenderer,
    TokenizedDataset,
    collate,
    conversation_from_record,
    load_dataset_records,
    read_jsonl,
    synthetic_greedy_dataset,
)
from .features import FeatureExtractor, OfflineFeatureDataset, extract_features, load_target
from .models import build_draft, merged_copy
from .objective import (
    BlockPlan,
    DMTPTrainingObjective,
    ObjectiveOutput,
    anchor_scores,
    build_attention_masks,
    plan_blocks,
    sample_anchors,
    summarize_metrics,
    valid_anchor_mask,
)
from .protocol import TrainingObjective
from .regenerate import regenerate
from .schedule import StepSchedule
from .trainer import Trainer

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
