"""`TrainConfig`: every training setting, typed and validated by ``huggingface_hub``'s strict dataclasses (as
`DMTPConfig` is), loaded from YAML with ``key=value`` overrides. Unknown keys, wrong types and impossible choices
are errors that name the key, before any model is loaded."""

import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError

from ..choices import ANCHOR_LAYOUTS, FUSIONS, MTP_HIDDEN_INPUTS  # not the draft's config: no torch to load here
from ..local_paths import require_local_folder

__all__ = ["LORA_TARGET_MODULES", "SYNTHETIC_PROMPT_LENGTH", "TrainConfig", "parse_synthetic_source"]

LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# `synthetic:<N>x<len>`: N random prompts of this many tokens, each continued greedily by the target to <len> tokens.
SYNTHETIC_PROMPT_LENGTH = 8
_SYNTHETIC = re.compile(r"synthetic:(\d+)x(\d+)")


def parse_synthetic_source(
    source: str, prompt_length: int = SYNTHETIC_PROMPT_LENGTH, key: str = "data source"
) -> tuple[int, int] | None:
    """``"synthetic:<N>x<len>"`` -> ``(N, len)``; ``None`` for any other source (a file or folder).

    Raises ``ValueError`` naming ``key`` (``train_data``...), the spec and what is valid unless it asks for N >= 1
    samples of ``len`` tokens that leave at least two generated (supervised) tokens after the ``prompt_length``-token
    prompt: a block is anchored on a supervised token and predicts the next, so a sample needs two in a row
    (``synthetic:0x64`` would fail in a reshape, ``synthetic:4x1`` in `generate` with ``max_new_tokens=-7``).
    """
    if not source.startswith("synthetic:"):
        return None
    match = _SYNTHETIC.fullmatch(source)
    num, length = (int(match[1]), int(match[2])) if match else (0, 0)
    if num < 1 or length < prompt_length + 2:
        raise ValueError(
            f"{key} {source!r}: expected synthetic:<N>x<len> with N >= 1 samples and len >= {prompt_length + 2} "
            f"tokens per sample (a random prompt of {prompt_length} tokens, then at least 2 tokens the target "
            "generates and the draft trains on), e.g. synthetic:64x128"
        )
    return num, length


AnchorLayout = Literal[ANCHOR_LAYOUTS]  # type: ignore[valid-type]
Fusion = Literal[FUSIONS]  # type: ignore[valid-type]
HiddenInput = Literal[MTP_HIDDEN_INPUTS]  # type: ignore[valid-type]


@strict
@dataclass(kw_only=True)
class TrainConfig:
    """Every training setting. Load with `TrainConfig.from_yaml`; see ``configs/*.yaml`` for documented examples."""

    # --- models
    target_model: str  # target checkpoint (``bundled``: the bundled target)
    init_from: str | None = None  # DFlash or DMTP draft checkpoint to continue from; None = from scratch
    anchor_layout: AnchorLayout = "dual"
    fusion: Fusion = "residual"  # dflash forces none
    draft_config: dict[str, Any] = field(default_factory=dict)  # DMTPConfig overrides (from scratch: sizes, mask id)
    attn_implementation: Literal["sdpa", "flex_attention", "eager"] = "sdpa"  # dense mask | BlockMask | eager
    mtp_hidden_input: HiddenInput = "post_norm"  # which target hidden the MTP head reads
    train_mtp_head: Literal["frozen", "only", "joint"] = "frozen"  # train the draft | the head alone | both
    mtp_init_from: str | None = None  # head checkpoint (`save_mtp_head`) to start from; None = the target's own
    mtp_retrofit: bool = False  # the target ships no MTP head: train a new one (retrofit layout)
    mtp_loss_weight: float = 1.0  # joint: weight of the head loss next to the draft loss
    mtp_kl_weight: float = 0.0  # head loss: CE + this * KL(target || head)
    mtp_draft_vocab_size: int | None = None  # a trained head predicts over this many frequent tokens (None: all)
    target_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # --- data
    train_data: str | list[str]  # JSONL, offline feature directory or synthetic:<N>x<len>; a list mixes ("path*0.5")
    labels: Literal["text", "target"] = "text"  # predict the text's tokens | the target's own greedy ones
    eval_data: str | None = None  # held-out set (same forms); None = `eval_holdout` train samples
    eval_holdout: int = 0  # train samples held out at random (seeded by `seed`) when eval_data is None
    tokenizer: str | None = None  # default: the target checkpoint
    enable_thinking: bool | None = None  # chat template `enable_thinking` (None: template default)
    mask_strategy: Literal["auto", "generation", "incremental"] = "auto"  # see training/data.py
    max_length: int = 4096
    # --- objective
    num_anchors: int = 512
    loss_decay_gamma: float | None = 4.0  # exp(-(j-1)/gamma) slot weights; 4 for 8-slot blocks (SpecForge)
    logits_chunk_size: int | None = None  # supervised slots per LM-head chunk (checkpointed); None = all at once
    selector_loss_weight: float = 1.0  # DFlash2: weight of the candidate selector's loss (SpecForge's alpha)
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
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU
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
    allow_config_change: bool = False  # resume even though settings that change the result differ from the run's
    rewarm_steps: int = 50  # resuming from weights only (fresh AdamW moments): the learning rate ramps up again
    eval_every: int = 500  # steps; 0 = never
    eval_batch_size: int = 4
    log_every: int = 10
    report_to: Literal["tensorboard", "none"] = "tensorboard"

    def validate_counts(self) -> None:
        """Sizes and counts are positive."""
        for key in ("micro_batch_size", "gradient_accumulation_steps", "num_anchors", "max_length", "num_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.logits_chunk_size is not None and self.logits_chunk_size < 1:
            raise ValueError("logits_chunk_size must be >= 1 (or null for no chunking)")

    def validate_data_sources(self) -> None:
        """``synthetic:<N>x<len>`` sources (alone or as ``path*weight`` items of a mixture) are well formed: refused
        here, before any model is loaded (`parse_synthetic_source`)."""
        train = self.train_data if isinstance(self.train_data, list) else [self.train_data]
        sources = [("train_data", source) for source in train] + [("eval_data", self.eval_data)]
        for key, source in sources:
            if source is not None:
                unweighted = source.rpartition("*")[0] if "*" in source else source
                parse_synthetic_source(unweighted, key=key)

    def validate_modes(self) -> None:
        """Layouts and head-training modes that fit together."""
        if self.anchor_layout == "dflash" and self.fusion != "none":
            self.fusion = "none"  # DFlash blocks have no T1 slot
        if self.train_mtp_head == "joint" and self.anchor_layout == "dflash":
            raise ValueError("train_mtp_head='joint' trains a DMTP draft with the head: anchor_layout 'single'/'dual'")
        if self.mtp_retrofit and self.train_mtp_head == "frozen" and not self.mtp_init_from:
            raise ValueError("mtp_retrofit builds an untrained head: train it (train_mtp_head only/joint)")
        if self.mtp_draft_vocab_size is not None and (self.train_mtp_head == "frozen" or self.mtp_draft_vocab_size < 1):
            raise ValueError(
                "mtp_draft_vocab_size (>= 1) gives a head being trained (train_mtp_head only/joint) a draft "
                "vocabulary; a frozen head keeps its checkpoint's"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Build and validate from a plain dict; ``ValueError`` names an unknown key, a wrong type or a bad value."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError("Unknown config key(s): " + "; ".join(_with_suggestion(key, names) for key in unknown))
        hints = typing.get_type_hints(cls)
        # YAML writes `1` for `1.0`: an int is a valid float setting (a bool is not).
        values = {
            key: float(value) if _takes_float(hints[key]) and type(value) is int else value
            for key, value in values.items()
        }
        try:
            return cls(**values)
        except (StrictDataclassFieldValidationError, StrictDataclassClassValidationError) as err:
            raise ValueError("Invalid training config: " + " ".join(str(err).split())) from None
        except TypeError as err:  # a required key is missing
            raise ValueError(str(err).replace("TrainConfig.__init__()", "The training config")) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Sequence[str] = ()) -> "TrainConfig":
        """Load a YAML file, then apply ``key=value`` overrides (values parsed as YAML)."""
        values = yaml.safe_load(Path(path).read_text()) or {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"Override {item!r} is not of the form key=value")
            values[key.strip()] = yaml.safe_load(raw)
        return cls.from_dict(values)

    def check_model_paths(self) -> None:
        """Raise ``FileNotFoundError`` for a model folder (target, ``init_from``, ``mtp_init_from``, tokenizer) that
        can only be local and does not exist: before any model is loaded, instead of a minute of Hub retries."""
        for key in ("target_model", "init_from", "mtp_init_from", "tokenizer"):
            require_local_folder(getattr(self, key), key)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (what is saved next to checkpoints)."""
        return dataclasses.asdict(self)


def _with_suggestion(key: Any, names: set[str]) -> str:
    """``'max_step' (did you mean 'max_steps'?)``: an unknown key with the closest field, if one is close."""
    close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def _takes_float(hint: Any) -> bool:
    return hint is float or float in typing.get_args(hint)
