"""Frozen features for draft training: target context features and the native MTP head's hidden states.

For a sequence ``x_0 .. x_{S-1}`` (one target forward, one teacher-forced MTP pass, all under ``no_grad``):

* ``context [S, k*H]``: ``hidden_states[i + 1]`` of the target for ``i`` in ``target_layer_ids``, concatenated (the
  DFlash context features);
* ``mtp_hidden [S, H]``: ``g_t`` = MTP head output for the pair ``(x_{t+1}, h_t)`` at position ``t``, which predicts
  ``x_{t+2}``; ``h_t`` is the target's last hidden state (post-norm by default, the tensor fed to the LM head). The
  last row (no ``x_S``) is zero and never read: anchors stop at ``S - 2`` and use ``g_{a-1}``;
* ``mtp_token [S]``: ``argmax lm_head(g_t)``, the MTP head's greedy guess for ``x_{t+2}`` (acceptance metric only);
* ``target_next [S]`` (``target_labels``): the target's own greedy next token after ``x_0 .. x_t``, from the same
  prefill. Training on it is self-distillation: on any text (teacher forcing) the draft and the head learn what the
  target would say next, not what the text says (`teacher_labels`). On answers the target regenerated greedily the
  two agree.

`FeatureExtractor` computes them online inside the trainer; `extract_features` / `main` (``dmtp extract``) write
them to safetensors shards, and `OfflineFeatureDataset` streams them back. Both paths share `FeatureExtractor`,
so online and offline training see the same numbers.

Shard format (``features-00000.safetensors``), samples concatenated along the token axis: ``input_ids [T]``,
``loss_mask [T]``, ``context [T, k*H]``, ``mtp_hidden [T, H]``, ``mtp_token [T]``, ``target_next [T]``,
``offsets [n + 1]``; plus
``index.json`` with the shard names, their sample counts and the extraction settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..assistant.target.loading import freeze, load_target
from ..bundled import resolve_target_path
from ..modeling.io import atomic_write_json
from ..modeling.native_mtp import NativeMTPHead, TargetHiddenExtractor, load_native_mtp
from .arguments import extract_parser
from .data import OfflineFeatureDataset, TokenizedDataset, collate, load_dataset_records

__all__ = [
    "FEATURE_KEYS",
    "FeatureExtractor",
    "OfflineFeatureDataset",
    "extract_features",
    "precompute_features",
    "freeze",
    "load_target",
    "main",
    "offline_final_hidden",
    "teacher_labels",
]

FEATURE_KEYS = ("context", "mtp_hidden", "mtp_token", "head_hidden", "target_next")


class FeatureExtractor:
    """Computes the frozen training features of a batch from the target and (optionally) its native MTP head.

    Args:
        target: the frozen target causal LM.
        target_layer_ids: 0-based target layers whose outputs form the context features.
        mtp_head: the frozen native MTP head, or None for the DFlash baseline (no MTP features).
        hidden_input: the target hidden the MTP head reads: ``"post_norm"`` (default) or ``"pre_norm"``.
        token_chunk: positions per LM-head chunk when computing ``mtp_token`` (bounds the ``[B, chunk, V]`` logits).
        head_inputs: also return ``head_hidden``, the hidden the head reads (training the head itself).
        final_hidden: also return ``final_hidden``, the post-norm hidden (the target's own distribution, for KL).
        target_labels: also return ``target_next``, the target's greedy next token at every position.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        target_layer_ids: Sequence[int],
        mtp_head: NativeMTPHead | None = None,
        hidden_input: str = "post_norm",
        token_chunk: int = 256,
        head_inputs: bool = False,
        final_hidden: bool = False,
        target_labels: bool = False,
    ):
        self.target = target
        self.target_layer_ids = list(target_layer_ids)
        self.mtp_head = mtp_head
        self.hidden_input = hidden_input
        self.token_chunk = token_chunk
        self.head_inputs = head_inputs
        self.final_hidden = final_hidden
        self.target_labels = target_labels

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Features of a right-padded batch ``input_ids [B, S]`` (see the module docstring for the keys)."""
        with TargetHiddenExtractor(self.target, self.hidden_input) as extract:
            outputs = self.target(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_hidden_states=True,
                use_cache=False,
                logits_to_keep=1,  # the target's own logits are not needed
            )
            last_hidden = extract(outputs)  # [B, S, H]
        features = {}
        if self.target_layer_ids:
            features["context"] = torch.cat([outputs.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        if self.head_inputs:
            features["head_hidden"] = last_hidden
        if self.final_hidden:
            features["final_hidden"] = outputs.hidden_states[-1]
        if self.target_labels:
            features["target_next"] = self.greedy_next(outputs.hidden_states[-1])
        if self.mtp_head is not None:
            features.update(self.mtp_features(input_ids, last_hidden))
        return features

    def batch_features(
        self, batch: dict[str, torch.Tensor], *, trains_head: bool, has_head: bool
    ) -> dict[str, torch.Tensor]:
        """The features of a collated batch: read from offline shards when the batch carries them (refused by name
        when they lack what this extractor would compute), else computed by `__call__`. The head's inputs must be
        there when the head is trained (``trains_head``), or when a head exists (``has_head``) and the shards hold
        none of its outputs (the trainer then runs it)."""
        if "context" not in batch and "head_hidden" not in batch:
            return self(batch["input_ids"], batch["attention_mask"])
        features = {k: batch[k] for k in FEATURE_KEYS if k in batch}
        if self.target_labels and "target_next" not in features:
            raise ValueError(
                "labels: target needs the target's own tokens, which these offline features lack: extract them "
                "with `dmtp extract --target-labels`"
            )
        if not self.target_labels:
            features.pop("target_next", None)  # labels: text
        needs_head_inputs = trains_head or (has_head and "mtp_hidden" not in features)
        if needs_head_inputs and "head_hidden" not in features:
            raise ValueError("These offline features hold no MTP head inputs: extract them with --head-inputs")
        if self.final_hidden and "final_hidden" not in features:
            features["final_hidden"] = offline_final_hidden(features, self.hidden_input)
        return features

    @torch.no_grad()
    def greedy_next(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` argmax of the target's LM head over its post-norm hidden ``[B, S, H]``, ``token_chunk``
        positions at a time (a 150K vocabulary makes full ``[B, S, V]`` logits gigabytes). Monotone logit
        transforms (soft-capping, temperature) never change an argmax, so the LM head alone is enough."""
        lm_head = self.target.get_output_embeddings()
        return torch.cat([lm_head(chunk).argmax(dim=-1) for chunk in final_hidden.split(self.token_chunk, dim=1)], 1)

    @torch.no_grad()
    def mtp_features(
        self, input_ids: torch.Tensor, last_hidden: torch.Tensor, token_positions: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """``mtp_hidden`` ``[B, S, H]`` and ``mtp_token`` ``[B, S]`` of the frozen head from the hidden it reads.

        Teacher-forced MTP pass: pair t = (x_{t+1}, h_t) at position t gives g_t (predicts x_{t+2}). The head is
        causal and the batch right-padded, so padding never reaches a real position. ``token_positions`` ``[B, N]``
        limits ``mtp_token`` to the positions the acceptance metric reads (the blocks' ``anchor - 1``; -1
        elsewhere): the LM head then runs on N rows instead of S, most of a frozen-head training step's cost.
        """
        bsz, seq_len = input_ids.shape
        positions = torch.arange(seq_len - 1, device=input_ids.device).expand(bsz, -1)
        g = self.mtp_head(input_ids[:, 1:], last_hidden[:, :-1], positions)  # [B, S-1, H]
        mtp_hidden = torch.cat([g, g.new_zeros(bsz, 1, g.shape[-1])], dim=1)  # [B, S, H]
        if token_positions is None:
            mtp_token = torch.cat(
                [self.mtp_head.logits(chunk).argmax(dim=-1) for chunk in mtp_hidden.split(self.token_chunk, dim=1)],
                dim=1,
            )
        else:
            index = token_positions[..., None].expand(-1, -1, mtp_hidden.shape[-1])
            guesses = self.mtp_head.logits(mtp_hidden.gather(1, index)).argmax(dim=-1)  # [B, N]
            mtp_token = input_ids.new_full((bsz, seq_len), -1).scatter(1, token_positions, guesses)
        return {"mtp_hidden": mtp_hidden, "mtp_token": mtp_token}


def _batched_features(
    extractor: FeatureExtractor,
    dataset: Sequence[dict[str, torch.Tensor]],
    batch_size: int,
    progress: bool,
    on_batch: Callable[[int], object] | None = None,
):
    """Yield ``{input_ids, loss_mask, <features>}`` per sample (unpadded, on CPU, in dataset order), computing
    features in batches of similar length: padding to the longest of eight random samples costs a third more target
    compute on regenerated chats (lengths 20-384), sorted batches about 4 %."""
    device = next(extractor.target.parameters()).device
    order = sorted(range(len(dataset)), key=lambda i: len(dataset[i]["input_ids"]))
    done: dict[int, dict[str, torch.Tensor]] = {}
    bar = tqdm(total=len(dataset), desc="features", disable=not progress)
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        samples = [dataset[i] for i in indices]
        batch = collate(samples)
        features = extractor(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        for row, (index, sample) in enumerate(zip(indices, samples, strict=True)):
            n = len(sample["input_ids"])
            item = {"input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long()}
            item.update({key: value[row, :n].cpu() for key, value in features.items()})
            done[index] = item
        bar.update(len(samples))
        if on_batch is not None:
            on_batch(len(samples))
    bar.close()
    for index in range(len(dataset)):
        yield done.pop(index)


def precompute_features(
    extractor: FeatureExtractor,
    dataset: Sequence[dict[str, torch.Tensor]],
    batch_size: int = 8,
    progress: bool = False,
) -> torch.utils.data.Dataset:
    """An in-memory dataset of samples with their features (offline training without touching the disk)."""
    return TokenizedDataset(list(_batched_features(extractor, dataset, batch_size, progress)))


# ----------------------------------------------------------------------------------------------------
# Offline features


def shard_name(index: int) -> str:
    """File name of feature shard ``index``."""
    return f"features-{index:05d}.safetensors"


def extract_features(
    extractor: FeatureExtractor,
    dataset: Sequence[dict[str, torch.Tensor]],
    output_dir: str | os.PathLike,
    *,
    batch_size: int = 8,
    shard_size: int = 1024,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    write_index: bool = True,
) -> Path:
    """Run ``extractor`` over ``dataset`` (items with ``input_ids``/``loss_mask``) and write safetensors shards.

    Shard k holds samples ``[k * shard_size, (k + 1) * shard_size)``; process ``rank`` of ``world_size`` writes the
    shards with ``k % world_size == rank``. Each shard is written atomically (a temporary file, then a rename), and a
    shard already on disk is skipped, so an interrupted extraction resumes where it stopped. ``index.json``, which
    training reads, is written last (``write_index``: by one process, once every shard exists). ``dtype`` casts the
    float features (e.g. ``torch.bfloat16`` to halve the disk footprint; None keeps the target's).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_shards = max(1, -(-len(dataset) // shard_size))
    mine = [k for k in range(num_shards) if k % world_size == rank and not (out / shard_name(k)).is_file()]
    todo = sum(min(shard_size, len(dataset) - k * shard_size) for k in mine)  # records in this process's shards
    bar = tqdm(total=todo, desc="features", disable=not progress)
    for k in mine:
        indices = range(k * shard_size, min((k + 1) * shard_size, len(dataset)))
        items = []
        shard = [dataset[i] for i in indices]
        for item in _batched_features(extractor, shard, batch_size, progress=False, on_batch=bar.update):
            items.append(
                {n: v.to(dtype) if dtype is not None and v.is_floating_point() else v for n, v in item.items()}
            )
        lengths = torch.tensor([len(s["input_ids"]) for s in items])
        tensors = {key: torch.cat([s[key] for s in items]).contiguous() for key in items[0]}
        tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        partial = out / f".{shard_name(k)}.partial"
        save_file(tensors, str(partial), metadata={"format": "pt"})
        os.replace(partial, out / shard_name(k))
    bar.close()
    if write_index and all((out / shard_name(k)).is_file() for k in range(num_shards)):
        shards = [
            {"file": shard_name(k), "num_samples": min(shard_size, len(dataset) - k * shard_size)}
            for k in range(num_shards)
        ]
        index = {
            "shards": shards,
            "num_samples": len(dataset),
            "target_layer_ids": extractor.target_layer_ids,
            "hidden_input": extractor.hidden_input,
            "has_mtp": extractor.mtp_head is not None,
            "has_head_inputs": extractor.head_inputs,
            "has_target_labels": extractor.target_labels,
            **(metadata or {}),
        }
        atomic_write_json(out / "index.json", index, indent=2)
    return out


# ----------------------------------------------------------------------------------------------------
# CLI: dmtp extract


def main(argv: Sequence[str] | None = None) -> int:
    """``dmtp extract``: tokenize a dataset, run the frozen target and MTP head, write feature shards."""

    from accelerate import PartialState

    args = extract_parser().parse_args(argv)
    # Under `accelerate launch`, every process extracts its own shards (shard k goes to rank k % world size).
    state = PartialState(cpu=not torch.cuda.is_available())
    device = args.device or str(state.device)
    target = load_target(args.target, dtype="auto", device=args.device_map or device)
    layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
    head = None if args.no_mtp else freeze(load_native_mtp(target, hidden_input=args.hidden_input))
    thinking = {"true": True, "false": False, "unset": None}[args.enable_thinking]
    dataset = load_dataset_records(
        args.data,
        tokenizer=args.tokenizer or _target_dir(args.target),
        max_length=args.max_length,
        enable_thinking=thinking,
        vocab_size=target.config.get_text_config().vocab_size,
    )
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    extractor = FeatureExtractor(
        target,
        layer_ids,
        head,
        hidden_input=args.hidden_input,
        head_inputs=args.head_inputs,
        target_labels=args.target_labels,
    )
    options = dict(
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        dtype=dtype,
        metadata={"target": str(args.target), "data": str(args.data)},
    )
    extract_features(
        extractor,
        dataset,
        args.output,
        rank=state.process_index,
        world_size=state.num_processes,
        write_index=False,
        progress=state.is_main_process,
        **options,
    )
    state.wait_for_everyone()
    if state.is_main_process:  # every shard exists now: only the index is written
        out = extract_features(extractor, dataset, args.output, progress=False, **options)
        print(f"wrote {len(dataset)} samples to {out} ({state.num_processes} process(es))")
    return 0


def _target_dir(target: str) -> str:
    """The tokenizer location implied by ``--target``."""
    return resolve_target_path(target)


def teacher_labels(input_ids: torch.Tensor, target_next: torch.Tensor | None) -> torch.Tensor:
    """``[B, S]`` the token each position must be predicted as: ``target_next`` shifted one to the right (position
    p is what the target says after ``x_0 .. x_{p-1}``; position 0, never a label, keeps ``x_0``), or the text
    itself when there are no target labels."""
    if target_next is None:
        return input_ids
    return torch.cat([input_ids[:, :1], target_next[:, :-1].to(input_ids.dtype)], dim=1)


def offline_final_hidden(features: dict[str, torch.Tensor], hidden_input: str) -> torch.Tensor:
    """The post-norm target hidden ``[B, S, H]`` the head's KL term needs, from offline features: the head's own
    input when it reads the post-norm hidden (the same tensor); pre-norm head inputs cannot give it."""
    if hidden_input != "post_norm":
        raise ValueError(
            "mtp_kl_weight > 0 needs the target's post-norm hidden, which offline features with pre-norm head "
            "inputs do not hold: set mtp_kl_weight: 0, or train online"
        )
    return features["head_hidden"]
