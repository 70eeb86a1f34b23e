"""The target's own MTP head in vLLM: the family's vLLM MTP model, the one ``{"method": "mtp"}`` runs, with the
weights the target checkpoint ships.

For a target whose family ships an MTP head (DeepSeek-V3, GLM-4.x, MiMo, Qwen3-Next, Qwen3.5/3.6), a DMTP draft
folder holds no copy of the head (``dmtp_config.mtp.source == "target"``): the plugin builds the family's vLLM MTP
model from the target's config and loads it from the target's checkpoint, through that model's own
``load_weights`` (its names, its fused projections and experts), reading only the files that hold head tensors.
Its embedding and LM head are dropped before loading: the head reads the target's embedding (the block's, which
vLLM shares with the target) and T1 comes from the target's LM head over the whole vocabulary, as in vLLM's own
``mtp`` method, where the checkpoint's copies (DeepSeek's and GLM's ``shared_head.head``) are the LM head's rows. (A
target checkpoint's head has no draft vocabulary: ``dmtp export-mtp`` refuses one.)

What each family's vLLM model returns differs: MiMo and the Qwen families return ``g`` (after the head's final
norm), GLM the hidden before it (its ``shared_head.norm`` gives ``g``), DeepSeek both. `NativeMTPHead` returns ``g``
for all of them, as dmtp-hf's ``NativeMTPHead`` does.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

__all__ = ["NATIVE_FAMILIES", "NativeFamily", "NativeMTPHead", "first_candidate", "target_mtp_tensors"]


@dataclass(frozen=True)
class NativeFamily:
    """A family's vLLM MTP model: where it lives, which target tensors are the head (``tensors``, a regex whose
    ``{N}`` is the target's depth) and, where its forward returns the hidden before the head's final norm, the path
    of that norm (``final_norm``, ``{N}`` as in ``tensors``)."""

    module: str
    model_class: str
    tensors: str
    final_norm: str | None = None


# dmtp-hf's layout names (``dmtp_config.mtp.layout``) -> the family's vLLM MTP model
NATIVE_FAMILIES = {
    "mimo": NativeFamily("vllm.model_executor.models.mimo_mtp", "MiMoMTP", r"model\.mtp_layers\."),
    "glm4_moe": NativeFamily(
        "vllm.model_executor.models.glm4_moe_mtp",
        "Glm4MoeMTP",
        r"model\.layers\.{N}\.",
        final_norm="model.layers.{N}.shared_head.norm",
    ),
    "deepseek_v3": NativeFamily("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP", r"model\.layers\.{N}\."),
    "qwen3_next": NativeFamily("vllm.model_executor.models.qwen3_next_mtp", "Qwen3NextMTP", r"mtp\."),
    "qwen3_5": NativeFamily("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MTP", r"mtp\."),
    "qwen3_5_moe": NativeFamily("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MoeMTP", r"mtp\."),
}
# Vocabulary-sized tensors of a head's checkpoint: copies of the target's embedding and LM head, not read.
_VOCAB_TENSORS = re.compile(r"(embed_tokens|shared_head\.head|lm_head)\.weight$")


def first_candidate(
    g: torch.Tensor, lm_head_weight: torch.Tensor, token_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """T1 ``[B]``, the argmax of ``g`` ``[B, H]`` under ``lm_head_weight`` ``[V, H]`` (mapped through
    ``token_ids`` ``[V]`` for a draft vocabulary), and its confidence ``[B]`` (the probability given to it)."""
    confidence, index = (g @ lm_head_weight.t()).float().softmax(dim=-1).max(dim=-1)
    return (index if token_ids is None else token_ids[index]), confidence


def target_mtp_tensors(target: str | os.PathLike, pattern: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the target checkpoint at ``target`` whose names match ``pattern`` (from the start), read from
    the files that hold them only (the shard index says which), vocabulary-sized copies left out."""
    from safetensors import safe_open

    folder = Path(target)
    if not folder.is_dir():  # a Hub id: the snapshot vLLM downloaded for the target
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(target), allow_patterns=["*.json", "*.safetensors"]))
    matches = re.compile(pattern).match
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({file for name, file in weight_map.items() if matches(name)})
    else:
        files = sorted(path.name for path in folder.glob("*.safetensors"))
    found = 0
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():
                if matches(name) and not _VOCAB_TENSORS.search(name):
                    found += 1
                    yield name, f.get_tensor(name)
    if not found:
        raise ValueError(
            f"The target checkpoint {target} holds no MTP head tensors (names matching {pattern!r}): a DMTP draft "
            "whose head is the target's own needs a checkpoint that ships it"
        )


class NativeMTPHead(nn.Module):
    """The target family's vLLM MTP model as DMTP's head: pairs ``(x_{t+1}, h_t)`` in, ``g_t`` out (module
    docstring). Built in the draft's own ``__init__`` (``vllm_config.model_config`` is the target's there, as for
    vLLM's ``mtp`` method), under ``prefix`` so its attention layers get KV caches of their own."""

    def __init__(self, vllm_config: VllmConfig, layout: str, prefix: str = ""):
        super().__init__()
        if layout not in NATIVE_FAMILIES:
            raise NotImplementedError(
                f"dmtp-vllm has no vLLM MTP model for the head layout {layout!r}; it serves native heads of "
                f"{sorted(NATIVE_FAMILIES)} and retrofitted ones"
            )
        self.family = NATIVE_FAMILIES[layout]
        self.num_target_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        model_class = getattr(importlib.import_module(self.family.module), self.family.model_class)
        with _as_mtp_draft(vllm_config):
            self.model = model_class(vllm_config=vllm_config, prefix=prefix)
        _drop_vocabulary_modules(self.model)
        self.final_norm = None
        if self.family.final_norm is not None:
            self.final_norm = self.model.get_submodule(self.family.final_norm.format(N=self.num_target_layers))

    @property
    def tensor_pattern(self) -> str:
        """Which tensors of the target checkpoint are the head (a regex)."""
        return self.family.tensors.format(N=self.num_target_layers)

    def load_target_weights(self, target: str | os.PathLike) -> None:
        """The head's weights from the target checkpoint at ``target``, through the family model's own loader."""
        self.model.load_weights(target_mtp_tensors(target, self.tensor_pattern))

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``embeds`` ``[N, H]`` = E(x_{t+1}), ``target_hidden`` ``[N, H]`` = h_t, ``positions`` ``[N]`` = t ->
        ``g`` ``[N, H]``, inside a forward context whose attention metadata is causal over the pairs."""
        out = self.model(
            input_ids=None, positions=positions, hidden_states=target_hidden.to(embeds.dtype), inputs_embeds=embeds
        )
        if isinstance(out, tuple):  # DeepSeek: (the hidden before the final norm, after it)
            return out[1]
        return out if self.final_norm is None else self.final_norm(out)

    def predict(self, g: torch.Tensor, target_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 ``[B]`` and its confidence ``[B]`` for ``g`` ``[B, H]`` under the target's LM head (`first_candidate`)."""
        return first_candidate(g, target_lm_head.weight)


@contextlib.contextmanager
def _as_mtp_draft(vllm_config: VllmConfig) -> Iterator[None]:
    """While a family's MTP model is built, the speculative config's draft model config is the target's, as under
    vLLM's ``mtp`` method (DeepSeek's layers read their config there; the others read ``model_config``)."""
    spec = vllm_config.speculative_config
    draft_model_config = spec.draft_model_config
    spec.draft_model_config = vllm_config.model_config
    try:
        yield
    finally:
        spec.draft_model_config = draft_model_config


def _drop_vocabulary_modules(model: nn.Module) -> None:
    """Replace the model's embedding and LM heads by nothing (module docstring): never read, and as large as the
    target's own."""
    for name, module in list(model.named_modules()):
        if name and isinstance(module, VocabParallelEmbedding):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, None)
