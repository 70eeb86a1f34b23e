"""Pretrain the bundled Qwen3.5-architecture target and its native MTP head jointly, from scratch.

The target is a `transformers` ``Qwen3_5ForCausalLM`` (GatedDeltaNet linear-attention + gated full-attention
layers, tied embeddings). Its MTP head is the project's `NativeMTPHead` built from the target, i.e. exactly the
module that `load_native_mtp` rebuilds at inference time. Both train on one joint loss, as real MTP models are
pretrained (DeepSeek-V3, Qwen3-Next/3.5)::

    h      = post-norm last hidden of the trunk (the tensor fed to lm_head)
    LM     = CE(lm_head(h_t), x_{t+1})
    g_t    = head(x_{t+1}, h_t)                     # one full-attention layer over the pairs
    MTP    = CE(lm_head(g_t), x_{t+2})
    total  = LM + mtp_weight * MTP                  # gradients of MTP reach the trunk through h and E

Checkpoints are written in the real Qwen3.5 on-disk layout: the trunk with ``save_pretrained`` and the head's
tensors under their checkpoint names (``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.norm``,
``mtp.layers.0.*``) inside the same ``model.safetensors`` — the inverse of `native_mtp.loading`'s mapping — so
``AutoModelForCausalLM.from_pretrained(path)`` + ``load_native_mtp(target)`` loads them like a downloaded model.

Training is resumable: the batch of step ``s`` is a pure function of ``(seed, s)`` (`PackedBatches`), and the
checkpoint holds model, head, optimizer, scheduler, RNG states and the step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bundled_tokenizer import END_OF_TEXT, IM_END, save_tokenizer
from fast_kernels import fast_gated_delta_kernels
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from dmtp_hf.modeling.io import atomic_directory
from dmtp_hf.modeling.native_mtp import MTPLayout, NativeMTPHead, get_mtp_layout, load_native_mtp

__all__ = [
    "TARGET_PRESETS",
    "JointOutput",
    "PackedBatches",
    "PretrainConfig",
    "build_target",
    "count_parameters",
    "joint_forward",
    "mtp_checkpoint_tensors",
    "pretrain",
    "render_corpus",
    "save_target_checkpoint",
    "target_config",
    "tokenize_documents",
    "verify_target_checkpoint",
]

logger = logging.getLogger(__name__)

LAYOUT_NAME = "qwen3_5_text"
CHECKPOINT_DIR, MODEL_DIR, STATE_FILE, METRICS_FILE = "checkpoint", "model", "state.pt", "metrics.jsonl"

# Architecture presets. `small` is the bundled target (~10M parameters with its MTP head); `tiny` is the same code
# path at test size. Layer pattern [linear, linear, full] as the real Qwen3.5 [linear x3, full] at 1/2 depth ratio.
TARGET_PRESETS: dict[str, dict[str, Any]] = {
    "small": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    },
    "tiny": {
        "hidden_size": 16,
        "intermediate_size": 32,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    },
}


def target_config(
    vocab_size: int, preset: str = "small", *, eos_token_id: int = 2, pad_token_id: int = 0, **overrides: Any
) -> Qwen3_5TextConfig:
    """The `Qwen3_5TextConfig` (``model_type="qwen3_5_text"``) of a preset, with one native MTP layer.

    RoPE is Qwen3.5's partial RoPE (a quarter of each head's dims); embeddings are tied as in the small Qwen3.5
    releases; ``mtp_num_hidden_layers: 1`` and ``mtp_use_dedicated_embeddings: false`` as in their configs.
    """
    if preset not in TARGET_PRESETS:
        raise ValueError(f"Unknown target preset {preset!r}; choose one of {sorted(TARGET_PRESETS)}")
    kwargs = {
        **TARGET_PRESETS[preset],
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        **overrides,
    }
    kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    config = Qwen3_5TextConfig(**kwargs)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def build_target(
    config: Qwen3_5TextConfig, seed: int = 0, attn_implementation: str = "sdpa"
) -> tuple[Qwen3_5ForCausalLM, NativeMTPHead]:
    """A randomly initialised target and its `NativeMTPHead` (initialised with the target's own init scheme).

    The head's norms are the target's zero-centred ``x_hat * (1 + w)`` norms, so the init (``w = 0``) is identity.
    """
    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = attn_implementation
    model = Qwen3_5ForCausalLM(config)
    head = NativeMTPHead(model, get_mtp_layout(LAYOUT_NAME))
    for module in head.modules():
        model._init_weights(module)
    return model, head


def count_parameters(model: nn.Module, head: nn.Module | None = None) -> dict[str, int]:
    """Parameter counts: trunk (tied embedding counted once), embedding, MTP head, total."""
    trunk = sum(p.numel() for p in model.parameters())  # `parameters()` deduplicates the tied weight
    embedding = model.get_input_embeddings().weight.numel()
    mtp = sum(p.numel() for p in head.parameters()) if head is not None else 0
    return {"trunk": trunk, "embedding": embedding, "mtp_head": mtp, "total": trunk + mtp}


# ----------------------------------------------------------------------------------------------------------------
# Joint LM + MTP objective


@dataclass
class JointOutput:
    """Losses and accuracies of one joint forward (MTP accuracy = top-1 of ``x_{t+2}``)."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    mtp_loss: torch.Tensor
    lm_accuracy: torch.Tensor
    mtp_accuracy: torch.Tensor
    mtp_logits: torch.Tensor | None = None


def joint_forward(
    model: Qwen3_5ForCausalLM,
    head: NativeMTPHead,
    input_ids: torch.LongTensor,
    mtp_weight: float = 0.3,
    return_mtp_logits: bool = False,
) -> JointOutput:
    """Teacher-forced joint forward over packed sequences ``[B, T]``.

    The head consumes the pairs ``(x_{t+1}, h_t)`` for ``t = 0 .. T-3`` at positions ``t`` (the hidden's position,
    the `NativeMTPHead` convention) and predicts ``x_{t+2}``.
    """
    batch_size, length = input_ids.shape
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state  # post-norm, fed to lm_head
    logits = model.lm_head(hidden[:, :-1])
    lm_labels = input_ids[:, 1:]
    lm_loss = F.cross_entropy(logits.flatten(0, 1).float(), lm_labels.flatten())

    positions = torch.arange(length - 2, device=input_ids.device).expand(batch_size, -1)
    mtp_hidden = head(input_ids[:, 1:-1], hidden[:, :-2], positions)
    mtp_logits = head.logits(mtp_hidden)
    mtp_labels = input_ids[:, 2:]
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1).float(), mtp_labels.flatten())
    with torch.no_grad():
        lm_accuracy = (logits.argmax(-1) == lm_labels).float().mean()
        mtp_accuracy = (mtp_logits.argmax(-1) == mtp_labels).float().mean()
    return JointOutput(
        loss=lm_loss + mtp_weight * mtp_loss,
        lm_loss=lm_loss,
        mtp_loss=mtp_loss,
        lm_accuracy=lm_accuracy,
        mtp_accuracy=mtp_accuracy,
        mtp_logits=mtp_logits if return_mtp_logits else None,
    )


# ----------------------------------------------------------------------------------------------------------------
# Real on-disk layout


def mtp_checkpoint_tensors(head: NativeMTPHead, layout: MTPLayout | None = None) -> dict[str, torch.Tensor]:
    """The head's tensors under their checkpoint names: the inverse of ``checkpoint_to_head_state_dict``.

    ``projection.weight`` -> ``mtp.fc.weight``, ``embedding_norm.*`` -> ``mtp.pre_fc_norm_embedding.*``,
    ``layer.<x>`` -> ``mtp.layers.0.<x>`` for the Qwen3.5 layout (dense MLP: no expert fusion to undo).
    """
    layout = layout or head.layout
    prefix = layout.checkpoint_prefix(head.config)
    tensors = {}
    for name, tensor in head.state_dict().items():
        part, _, rest = name.partition(".")
        if part in layout.tensor_names:
            checkpoint_name = f"{prefix}{layout.tensor_names[part]}.{rest}"
        elif part == "layer":
            checkpoint_name = f"{prefix}{layout.block_prefix}{rest}"
        else:
            raise ValueError(f"Head tensor {name!r} has no place in the {layout.name} checkpoint layout")
        tensors[checkpoint_name] = tensor.detach().contiguous()
    return tensors


def save_target_checkpoint(
    model: Qwen3_5ForCausalLM,
    head: NativeMTPHead,
    directory: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write target + MTP head (+ tokenizer) atomically in the real Qwen3.5 layout, weights in ``dtype``."""
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        export = copy.deepcopy(model).to(dtype)
        export.config.architectures = [type(model).__name__]
        export.save_pretrained(tmp)
        del export
        weights_file = tmp / "model.safetensors"
        tensors = load_file(str(weights_file))
        mtp = {name: tensor.to(dtype) for name, tensor in mtp_checkpoint_tensors(head).items()}
        clash = sorted(set(tensors) & set(mtp))
        if clash:
            raise ValueError(f"Trunk and MTP tensor names overlap: {clash}")
        save_file({**tensors, **mtp}, str(weights_file), metadata={"format": "pt"})
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        # The temporary directory (and safetensors' file) are private (0700/0600); a model folder is for sharing.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
    return directory


def _rounded_copy(model: Qwen3_5ForCausalLM, head: NativeMTPHead, dtype: torch.dtype):
    """Float32 copies of model and head whose weights went through ``dtype`` (what a ``dtype`` save keeps)."""
    reference = copy.deepcopy(model).float()
    reference_head = NativeMTPHead(reference, head.layout, hidden_input=head.hidden_input)
    reference_head.load_state_dict(head.state_dict())
    reference_head.float()
    with torch.no_grad():
        for parameter in [*reference.parameters(), *reference_head.parameters()]:
            parameter.copy_(parameter.to(dtype).float())
    return reference.eval(), reference_head.eval()


@torch.no_grad()
def verify_target_checkpoint(
    directory: str | os.PathLike,
    model: Qwen3_5ForCausalLM,
    head: NativeMTPHead,
    input_ids: torch.LongTensor,
    dtype: torch.dtype = torch.bfloat16,
    atol: float = 1e-4,
) -> dict[str, float]:
    """Load ``directory`` with ``AutoModelForCausalLM`` + `load_native_mtp` and compare with the training modules.

    The training modules are compared after rounding their weights to the saved ``dtype`` (identity for
    float32), both sides computed in float32. Raises `AssertionError` when LM or MTP logits differ by more than
    ``atol``; returns the max absolute differences.
    """
    reference, reference_head = _rounded_copy(model, head, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation=model.config._attn_implementation
    ).eval()
    loaded_head = load_native_mtp(loaded, str(directory), dtype=torch.float32)
    expected = joint_forward(reference, reference_head, input_ids, return_mtp_logits=True)
    actual = joint_forward(loaded, loaded_head, input_ids, return_mtp_logits=True)
    lm_expected = reference(input_ids=input_ids, use_cache=False).logits
    lm_actual = loaded(input_ids=input_ids, use_cache=False).logits
    diffs = {
        "mtp_logits_max_abs_diff": (expected.mtp_logits - actual.mtp_logits).abs().max().item(),
        "lm_logits_max_abs_diff": (lm_expected - lm_actual).abs().max().item(),
    }
    if max(diffs.values()) > atol:
        raise AssertionError(f"Checkpoint {directory} does not reproduce the training modules: {diffs}")
    return diffs


# ----------------------------------------------------------------------------------------------------------------
# Data


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def render_corpus(corpus_dir: str | os.PathLike, tokenizer: PreTrainedTokenizerBase, split: str) -> list[str]:
    """The pretraining documents of ``split`` (``"train"`` or ``"heldout"``) as text, each ending in ``<|endoftext|>``.

    Raw stdlib files as they are; chats (chitchat and code requests) rendered with the tokenizer's chat template,
    so the target learns the exact format it is later prompted with.
    """
    corpus_dir = Path(corpus_dir)
    names = {
        "train": ("train_code", "train_code_chat", "train_chat"),
        "heldout": ("heldout_code_text", "heldout_code", "heldout_chat"),
    }[split]
    documents = []
    for name in names:
        for row in _read_jsonl(corpus_dir / f"{name}.jsonl"):
            if "text" in row:
                text = row["text"]
            else:
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
            documents.append(text + END_OF_TEXT)
    return documents


def tokenize_documents(
    documents: Sequence[str], tokenizer: PreTrainedTokenizerBase, seed: int = 0, shuffle: bool = True
) -> torch.Tensor:
    """Concatenate the token ids of ``documents`` (shuffled with ``seed`` so workloads interleave) into one stream."""
    order = list(range(len(documents)))
    if shuffle:
        random.Random(seed).shuffle(order)
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer
    encodings = backend.encode_batch([documents[i] for i in order], add_special_tokens=False)
    dtype = torch.int16 if len(tokenizer) < 2**15 else torch.int32  # halves the cache for small vocabularies
    return torch.cat([torch.tensor(encoding.ids, dtype=dtype) for encoding in encodings])


class PackedBatches:
    """Fixed-length windows of a token stream, in a seeded per-epoch order; the batch of a step is deterministic.

    ``batch(step)`` depends only on ``(seed, step)``, so a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0):
        self.num_windows = tokens.numel() // seq_len
        if self.num_windows < batch_size:
            raise ValueError(f"{tokens.numel()} tokens make {self.num_windows} windows, fewer than one batch")
        self.windows = tokens[: self.num_windows * seq_len].view(self.num_windows, seq_len)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._epoch, self._order = -1, None
        self.batches_per_epoch = self.num_windows // batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_windows, generator=generator)
        return self._order

    def batch(self, step: int) -> torch.LongTensor:
        """The ``[batch_size, seq_len]`` input ids of training step ``step`` (0-based)."""
        epoch, index = divmod(step, self.batches_per_epoch)
        rows = self._epoch_order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        return self.windows[rows].long()

    def epoch_of(self, step: int) -> float:
        """Fractional epoch reached after ``step`` steps."""
        return step / self.batches_per_epoch


# ----------------------------------------------------------------------------------------------------------------
# Training loop


@dataclass
class PretrainConfig:
    """Hyper-parameters and bookkeeping of one pretraining run (saved with every checkpoint)."""

    output_dir: str
    preset: str = "small"
    seq_len: int = 512
    batch_size: int = 4
    max_steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    seed: int = 0
    save_every: int = 50
    save_every_minutes: float = 15.0
    eval_every: int = 100
    log_every: int = 5
    eval_batches: int = 4
    export_dtype: str = "bfloat16"
    fast_kernels: bool = True
    progress: bool = True

    # Keys that may change between a run and its resumption (the rest must match the checkpoint).
    RESUMABLE_CHANGES = (
        "max_steps",
        "save_every",
        "save_every_minutes",
        "eval_every",
        "log_every",
        "progress",
        "output_dir",
        "fast_kernels",
    )


def _lr_lambda(config: PretrainConfig):
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _optimizer(model: nn.Module, head: nn.Module, config: PretrainConfig) -> torch.optim.Optimizer:
    # No weight decay on norms, biases and the 1-D GatedDeltaNet parameters (A_log, dt_bias): only on matrices.
    params = {id(p): p for p in [*model.parameters(), *head.parameters()] if p.requires_grad}.values()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def _settings(config: PretrainConfig) -> dict[str, Any]:
    """The config as saved in a checkpoint (JSON-like: tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def _changed_settings(config: PretrainConfig, saved: dict[str, Any]) -> list[str]:
    """Settings of ``config`` that differ from a checkpoint's and may not change on resume."""
    current = _settings(config)
    return [key for key, value in current.items() if key not in config.RESUMABLE_CHANGES and saved.get(key) != value]


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


@torch.no_grad()
def _evaluate(model, head, batches: Sequence[torch.Tensor], mtp_weight: float) -> dict[str, float]:
    model.eval(), head.eval()
    totals: dict[str, float] = {}
    for input_ids in batches:
        out = joint_forward(model, head, input_ids, mtp_weight)
        for key in ("lm_loss", "mtp_loss", "lm_accuracy", "mtp_accuracy"):
            totals[key] = totals.get(key, 0.0) + getattr(out, key).item() / len(batches)
    model.train(), head.train()
    return totals


def _append_metrics(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _progress(iterable: Iterator[int], total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    # Not a terminal (nohup > log): a line every 30 s instead of a carriage-return storm.
    return tqdm(iterable, total=total, initial=initial, disable=not enabled, mininterval=30.0, dynamic_ncols=True)


def pretrain(
    config: PretrainConfig,
    train_tokens: torch.Tensor,
    eval_tokens: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
    model_config: Qwen3_5TextConfig | None = None,
) -> dict[str, Any]:
    """Run (or resume) joint LM + MTP pretraining; returns the final step's metrics.

    Writes under ``config.output_dir``: ``checkpoint/`` (training state, atomic), ``model/`` (the latest export in
    the real Qwen3.5 layout with the tokenizer, atomic, verified after each write) and ``metrics.jsonl``.
    Relaunching with the same arguments resumes from ``checkpoint/`` (``max_steps`` may be raised).
    """
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir, model_dir, metrics_file = (
        output_dir / CHECKPOINT_DIR,
        output_dir / MODEL_DIR,
        output_dir / METRICS_FILE,
    )
    export_dtype = getattr(torch, config.export_dtype)
    if model_config is None:
        model_config = target_config(
            len(tokenizer),
            config.preset,
            eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
            pad_token_id=tokenizer.pad_token_id,
        )
    model, head = build_target(model_config, seed=config.seed)
    model.train(), head.train()
    optimizer = _optimizer(model, head, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    batches = PackedBatches(train_tokens, config.seq_len, config.batch_size, seed=config.seed)
    eval_stream = PackedBatches(eval_tokens, config.seq_len, config.batch_size, seed=config.seed)
    # Fixed held-out windows spread evenly over the stream, so every held-out workload (code, code chat, chat) counts.
    num_eval = min(config.eval_batches, eval_stream.batches_per_epoch) * config.batch_size
    spread = torch.linspace(0, eval_stream.num_windows - 1, num_eval).long()
    eval_batches = [eval_stream.windows[rows].long() for rows in spread.split(config.batch_size)]

    step, tokens_seen = 0, 0
    state_file = checkpoint_dir / STATE_FILE
    if state_file.exists():
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        changed = _changed_settings(config, state["config"])
        if changed:
            raise ValueError(f"Cannot resume {state_file}: settings differ from the checkpoint's: {changed}")
        model.load_state_dict(state["model"])
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        # The schedule depends on max_steps, which may have been raised: rebuild it at the saved step.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config), last_epoch=state["step"] - 1)
        _set_rng_state(state["rng"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        logger.info("Resumed from %s at step %d (%d tokens seen)", state_file, step, tokens_seen)

    parameters = count_parameters(model, head)
    logger.info(
        "Target %s: %s parameters; %d training windows of %d tokens (%.1f steps per epoch)",
        config.preset,
        parameters,
        batches.num_windows,
        config.seq_len,
        batches.batches_per_epoch,
    )

    def save(final: bool = False) -> None:
        with atomic_directory(checkpoint_dir) as tmp:
            state = {
                "model": model.state_dict(),
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": _rng_state(),
                "step": step,
                "tokens_seen": tokens_seen,
                "config": _settings(config),
            }
            torch.save(state, tmp / STATE_FILE)
        save_target_checkpoint(model, head, model_dir, tokenizer, dtype=export_dtype)
        model.eval(), head.eval()
        diffs = verify_target_checkpoint(model_dir, model, head, eval_batches[0][:1, :64], dtype=export_dtype)
        model.train(), head.train()
        (model_dir / "training_state.json").write_text(
            json.dumps({"step": step, "tokens_seen": tokens_seen, "final": final, "verify": diffs}, indent=2) + "\n"
        )
        logger.info("Checkpoint at step %d -> %s, %s (verified: %s)", step, checkpoint_dir, model_dir, diffs)

    last_save, window_start, window_cpu, window_tokens = time.monotonic(), time.monotonic(), time.process_time(), 0
    metrics: dict[str, Any] = {}
    bar = _progress(iter(range(step, config.max_steps)), config.max_steps, step, config.progress)
    for step_index in bar:
        input_ids = batches.batch(step_index)
        with fast_gated_delta_kernels(config.fast_kernels):
            out = joint_forward(model, head, input_ids, config.mtp_weight)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([*model.parameters(), *head.parameters()], config.grad_clip)
        optimizer.step()
        scheduler.step()
        step, tokens_seen, window_tokens = (
            step_index + 1,
            tokens_seen + input_ids.numel(),
            window_tokens + input_ids.numel(),
        )
        metrics = {
            "step": step,
            "epoch": round(batches.epoch_of(step), 4),
            "tokens_seen": tokens_seen,
            "lr": scheduler.get_last_lr()[0],
            "loss": out.loss.item(),
            "lm_loss": out.lm_loss.item(),
            "mtp_loss": out.mtp_loss.item(),
            "lm_acc": out.lm_accuracy.item(),
            "mtp_acc": out.mtp_accuracy.item(),
            "grad_norm": grad_norm.item(),
        }
        bar.set_postfix(
            lm=f"{metrics['lm_loss']:.3f}",
            mtp=f"{metrics['mtp_loss']:.3f}",
            mtp_acc=f"{metrics['mtp_acc']:.3f}",
            refresh=False,
        )
        if step % config.log_every == 0 or step == config.max_steps:
            elapsed = time.monotonic() - window_start
            metrics["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
            # Per CPU-second of this process (all its threads): the rate free of other users' load on the machine.
            metrics["tokens_per_cpu_s"] = window_tokens / max(time.process_time() - window_cpu, 1e-9)
            window_start, window_cpu, window_tokens = time.monotonic(), time.process_time(), 0
            _append_metrics(metrics_file, {"split": "train", **metrics})
            logger.info("train %s", json.dumps(metrics))
        if step % config.eval_every == 0 or step == config.max_steps:
            with fast_gated_delta_kernels(config.fast_kernels):
                evaluation = _evaluate(model, head, eval_batches, config.mtp_weight)
            evaluation = {"split": "heldout", "step": step, **evaluation}
            _append_metrics(metrics_file, evaluation)
            logger.info("eval %s", json.dumps(evaluation))
            metrics["heldout"] = evaluation
        due = time.monotonic() - last_save > 60 * config.save_every_minutes
        if step % config.save_every == 0 or due or step == config.max_steps:
            save(final=step == config.max_steps)
            last_save = time.monotonic()
    bar.close()
    if not metrics and not (model_dir / "training_state.json").exists():
        save(final=step >= config.max_steps)  # max_steps already reached before any step ran: still export
    return metrics
