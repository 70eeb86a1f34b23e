"""The DMTP draft in vLLM's own layers: vLLM's DFlash draft plus the two things DMTP adds.

``DFlashDMTPDraftModel`` (the architecture ``dmtp convert --to vllm`` writes) is vLLM's ``DFlashQwen3ForCausalLM``,
whose block layers, context K/V projection and paged cache are used unchanged, plus:

* ``mtp``: the MTP head that proposes T1. For a pair ``(x_{t+1}, h_t)`` at position t::

      u_t = projection([embedding_norm(E(x_{t+1})) ; hidden_norm(h_t)])
      g_t = final_norm(layer(u_{<=t}))          # the decoder layer attends over earlier pairs (its own KV cache)
      T1  = argmax lm_head(g_t)                 # over the head's draft vocabulary when it has one

  A target family's own head (``dmtp_config.mtp.source == "target"``) is that family's vLLM MTP model, loaded from
  the target checkpoint (`dmtp_vllm.native`); a retrofitted head (`MTPHead`, weights under ``mtp.*`` in the draft
  folder) is a Llama decoder layer between dmtp-hf's norms and projection. Either way the layer's attention is a
  vLLM ``Attention`` with a paged KV cache that vLLM allocates next to the block's;
* ``fusion``: the block's T1 slot is ``E(T1) + proj([RMS_e(E(T1)) ; RMS_m(g)])`` instead of the mask embedding.

The proposer (`dmtp_vllm.proposer`) runs the two in order each round. Weight names are those of the dmtp-hf export
(unprefixed DFlash tensors, ``fusion.*``, ``mtp.*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model
from vllm.model_executor.models.utils import maybe_prefix

from .native import NativeMTPHead, first_candidate

__all__ = ["ARCHITECTURE", "DFlashDMTPDraftModel", "FirstCandidateFusion", "MTPHead"]

ARCHITECTURE = "DFlashDMTPDraftModel"

# Checkpoint names of a decoder layer's separate projections -> vLLM's fused parameter and shard.
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_named(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Load checkpoint tensors into ``module`` (separate q/k/v and gate/up projections fused as vLLM stores them);
    every parameter must be filled and every tensor used, else ``ValueError`` names them."""
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    filled: set[str] = set()
    unused = []
    for name, tensor in weights:
        module_path, _, leaf = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        shard = None
        if module_name in _STACKED:
            fused, shard = _STACKED[module_name]
            name = f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}"
        if name not in params:
            unused.append(name)
            continue
        param = params[name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            if isinstance(param, nn.Parameter):
                loader(param, tensor)
            else:
                param.copy_(tensor)
        else:
            loader(param, tensor, shard)
        filled.add(name)
    missing = sorted(set(dict(module.named_parameters())) - filled)
    if unused or missing:
        raise ValueError(f"{what}: tensors the model does not use {unused[:10]}, parameters not loaded {missing[:10]}")


class FirstCandidateFusion(nn.Module):
    """``E(T1) + proj([RMS_e(E(T1)) ; RMS_m(g)])``: the block's T1 slot (dmtp-hf's ``residual`` fusion)."""

    def __init__(self, hidden_size: int, mtp_hidden_size: int, eps: float, prefix: str = ""):
        super().__init__()
        self.embedding_norm = RMSNorm(hidden_size, eps=eps)
        self.mtp_norm = RMSNorm(mtp_hidden_size, eps=eps)
        self.proj = ReplicatedLinear(
            hidden_size + mtp_hidden_size, hidden_size, bias=False, prefix=f"{prefix}.proj", return_bias=False
        )

    def residual(self, t1_embeds: torch.Tensor, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """What the fusion adds to ``E(T1)``: ``t1_embeds`` ``[B, H]``, ``mtp_hidden`` ``[B, H_mtp]`` (the g that
        predicted T1) -> ``[B, H]``."""
        normed = torch.cat([self.embedding_norm(t1_embeds), self.mtp_norm(mtp_hidden.to(t1_embeds.dtype))], dim=-1)
        return self.proj(normed)

    def forward(self, t1_embeds: torch.Tensor, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """``E(T1) + residual``: the T1 slot's input ``[B, H]``."""
        return t1_embeds + self.residual(t1_embeds, mtp_hidden)


class DMTPBlockModel(DFlashQwen3Model):
    """vLLM's DFlash block model whose input embeddings add ``slot_residual`` (the fusion's term at the T1 slots,
    zero elsewhere). The proposer fills it before each block pass and writes T1 into the T1 slots' ids: the block
    then reads ``E(T1) + fusion residual`` there. A buffer, not an ``inputs_embeds`` argument, because vLLM compiles
    this forward once (traced without ``inputs_embeds``) and replays that graph."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id, prefix=prefix)
        spec = vllm_config.speculative_config
        rows = vllm_config.scheduler_config.max_num_seqs * (1 + spec.num_speculative_tokens)
        rows += vllm_config.compilation_config.max_cudagraph_capture_size or 0
        self.register_buffer(
            "slot_residual",
            torch.zeros(rows, self.config.hidden_size, dtype=vllm_config.model_config.dtype),
            persistent=False,
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """DFlash's embeddings plus the T1 slots' fusion residual."""
        embeds = super().embed_input_ids(input_ids)
        return embeds + self.slot_residual[: input_ids.shape[0]].to(embeds.dtype)


class MTPHead(nn.Module):
    """A retrofitted MTP head in vLLM layers: pairs ``(x_{t+1}, h_t)`` in, ``g_t`` out (module docstring).
    ``layer`` is a Llama decoder layer built from the target's config."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        target_config: Any,
        head_config: dict[str, Any],
        layer_index: int,
        prefix: str = "",
    ):
        super().__init__()
        if target_config.model_type not in ("llama",):
            raise NotImplementedError(
                f"dmtp-vllm builds a retrofitted MTP head's decoder layer for Llama-family targets; this target is "
                f"{target_config.model_type!r} (a family's own head is read from the target: export the draft with "
                "`dmtp convert ... --to vllm --target TARGET` and no --mtp-head)"
            )
        hidden, eps = target_config.hidden_size, target_config.rms_norm_eps
        self.hidden_first = bool(head_config.get("hidden_first", False))
        self.embedding_norm = RMSNorm(hidden, eps=eps)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.projection = ReplicatedLinear(
            2 * hidden, hidden, bias=False, prefix=f"{prefix}.projection", return_bias=False
        )
        # vLLM keys KV caches by a layer index in the name: one past the draft's block layers.
        self.layer = LlamaDecoderLayer(vllm_config, prefix=f"{prefix}.layers.{layer_index}", config=target_config)
        self.final_norm = RMSNorm(hidden, eps=eps)
        vocab = head_config.get("draft_vocab_size")
        # A draft vocabulary: the target LM head's rows of those tokens, and their target ids.
        self.lm_head_weight = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False) if vocab else None
        self.register_buffer("token_ids", torch.zeros(vocab, dtype=torch.long) if vocab else None)

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``embeds`` ``[N, H]`` = E(x_{t+1}), ``target_hidden`` ``[N, H]`` = h_t, ``positions`` ``[N]`` = t ->
        ``g`` ``[N, H]``. Runs inside a forward context whose attention metadata is causal over the pairs."""
        parts = [self.embedding_norm(embeds), self.hidden_norm(target_hidden.to(embeds.dtype))]
        if self.hidden_first:
            parts.reverse()
        hidden = self.projection(torch.cat(parts, dim=-1))
        hidden, residual = self.layer(positions, hidden, None)
        return self.final_norm(hidden, residual)[0]

    def predict(self, g: torch.Tensor, target_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 ``[B]`` (the argmax of the head's logits for ``g`` ``[B, H]``) and its confidence ``[B]`` (the
        probability the head gave it)."""
        if self.lm_head_weight is None:
            return first_candidate(g, target_lm_head.weight)
        return first_candidate(g, self.lm_head_weight, self.token_ids)


class DFlashDMTPDraftModel(DFlashQwen3ForCausalLM):
    """vLLM's DFlash draft plus the MTP head and the first-candidate fusion (module docstring)."""

    model_cls = DMTPBlockModel

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        dmtp = config.dmtp_config
        if dmtp.get("anchor_layout") != "dual" or dmtp.get("fusion") not in ("residual", "none"):
            raise ValueError(f"dmtp-vllm runs dual-anchor drafts with residual or no fusion, got {dmtp}")
        target_config = vllm_config.speculative_config.target_model_config.hf_config
        target_hidden = target_config.hidden_size
        # vLLM sized `fc` for every captured target layer; the last one is the target's final hidden (for the MTP
        # head), so the block's features are the first len(target_layer_ids).
        self.num_context_features = len(config.dflash_config["target_layer_ids"])
        self.model.fc = ReplicatedLinear(
            self.num_context_features * target_hidden,
            config.hidden_size,
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            prefix=maybe_prefix(prefix, "model.fc"),
            return_bias=False,
        )
        self.context_width = self.num_context_features * target_hidden
        # The target's last layer (the hidden its final norm reads) among the captured layers, which vLLM
        # concatenates once each in layer order: its own slot, or the last feature's when a feature layer is the last
        captured = sorted(set(config.eagle_aux_hidden_state_layer_ids))
        last = captured.index(vllm_config.model_config.get_total_num_hidden_layers())
        self.last_layer_columns = slice(last * target_hidden, (last + 1) * target_hidden)
        self.mtp_hidden_input = dmtp["mtp"].get("hidden_input", "post_norm")
        self.fusion = None
        if dmtp["fusion"] == "residual":
            self.fusion = FirstCandidateFusion(
                config.hidden_size, dmtp["mtp_hidden_size"], config.rms_norm_eps, prefix=maybe_prefix(prefix, "fusion")
            )
        head = dmtp["mtp"]
        self.target_path = vllm_config.model_config.model  # where a family's own head is read from
        if head.get("source") == "target":
            self.mtp = NativeMTPHead(vllm_config, head["layout"], prefix=maybe_prefix(prefix, "mtp"))
        else:
            layer_index = vllm_config.model_config.get_total_num_hidden_layers() + config.num_hidden_layers
            self.mtp = MTPHead(vllm_config, target_config, head, layer_index, prefix=maybe_prefix(prefix, "mtp"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """DFlash tensors through vLLM's DFlash loader; ``fusion.*`` and ``mtp.*`` into this model's modules; a
        family's own head from the target checkpoint (the folder then holds no ``mtp.*``)."""
        own: dict[str, list[tuple[str, torch.Tensor]]] = {"fusion": [], "mtp": []}
        rest = []
        for name, tensor in weights:
            group, _, leaf = name.partition(".")
            if group in own:
                own[group].append((_mtp_name(leaf) if group == "mtp" else leaf, tensor))
            else:
                rest.append((name, tensor))
        super().load_weights(rest)
        if self.fusion is not None:
            load_named(self.fusion, own["fusion"], "the DMTP fusion")
        if isinstance(self.mtp, NativeMTPHead):
            if own["mtp"]:
                raise ValueError(
                    f"This DMTP folder names the target's own head (dmtp_config.mtp.source 'target') but carries "
                    f"head tensors {[name for name, _ in own['mtp']][:5]}: export it again with `dmtp convert`"
                )
            self.mtp.load_target_weights(self.target_path)
        else:
            load_named(self.mtp, own["mtp"], "the MTP head")


def _mtp_name(name: str) -> str:
    """``lm_head.weight`` of the head's draft vocabulary is the ``lm_head_weight`` parameter."""
    return "lm_head_weight" if name == "lm_head.weight" else name
