"""`NativeMTPHead`: the target's own pretrained MTP layer (stateless; the round state lives in the generation layer).

For one pair ``(x_{t+1}, h_t)`` (the token at t+1 and the target hidden state at t)::

    u_t = projection([embedding_norm(E(x_{t+1})) ; hidden_norm(h_t)])     # [hidden ; embedding] for MiMo-7B
    v_t = layer(u_{<=t})                                                   # one full-attention decoder layer
    g_t = final_norm(v_t)                                                  # predicts x_{t+2}: lm_head(g_t)

``E``, ``lm_head`` and the RoPE module are the target's own (referenced, never copied, never registered as
submodules, so they are neither saved nor moved with the head). The block, its norms and the input norms are built
from the target's classes (``type(decoder.layers[-1])``, ``type(decoder.norm)``): Qwen3-Next/3.5/3.6 norms are
therefore the zero-centred ``x_hat * (1 + w)`` ones, DeepSeek/GLM/Qwen2 the plain ``x_hat * w`` ones.

Position convention: a pair gets the position of its *hidden* state ``h_t`` (as vLLM does), i.e. the pair
``(x_{t+1}, h_t)`` is at position ``t``. RoPE is shift-invariant, so Transformers' ``MtpModel`` (token position
``t + 1``) gives the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask

from ..configuration_dmtp import MTP_HIDDEN_INPUTS
from ..draft_vocab import register_draft_vocabulary, scatter_to_vocabulary, subset_head_logits
from .layouts import MTPLayout, build_mtp_layer_config

__all__ = ["HIDDEN_INPUTS", "NativeMTPHead"]

HIDDEN_INPUTS = MTP_HIDDEN_INPUTS  # one definition, in the draft config
HiddenInput = Literal["post_norm", "pre_norm"]


@dataclass
class _SharedTargetModules:
    """The target modules the head uses without owning them (a plain object, so `nn.Module` does not register
    them: they are not in the head's ``state_dict``, and ``head.to(...)`` does not move the target)."""

    embed_tokens: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module | None


class NativeMTPHead(nn.Module):
    """One native MTP layer of a target model, stateless: pairs in, ``g`` out (the round's state is the caller's).

    Build it with `load_native_mtp` (which fills the weights from the target's checkpoint); the constructor only
    creates the modules from the target's own classes.

    Args:
        target: The target causal LM (text-only or multimodal wrapper); its embedding, LM head and RoPE are used.
        layout: The family's `MTPLayout` (concat order, config changes for the block).
        hidden_input: Which target hidden state the head is fed: ``"post_norm"`` (default, as vLLM/SGLang/HF:
            ``outputs.hidden_states[-1]``, the tensor fed to ``lm_head``) or ``"pre_norm"`` (the last decoder
            layer's output before the final norm). Only a label here: callers extract the matching tensor with
            `TargetHiddenExtractor`.

    The head is stateless: `forward` maps pairs to ``g`` (with an optional KV cache the caller owns) and `logits`
    maps ``g`` to the vocabulary. The decoding-round state (its private KV cache, the ``g`` that predicts the next
    T1) lives in the generation layer (``dmtp_hf.assistant.drafters.state.MTPState``).
    """

    def __init__(self, target: PreTrainedModel, layout: MTPLayout, *, hidden_input: HiddenInput = "post_norm"):
        super().__init__()
        if hidden_input not in HIDDEN_INPUTS:
            raise ValueError(f"hidden_input must be one of {HIDDEN_INPUTS}, got {hidden_input!r}")
        text_config = target.config.get_text_config(decoder=True)
        decoder = target.get_decoder()
        self.layout = layout
        self.hidden_input = hidden_input
        # Where this target keeps the head's tensors (DeepSeek/GLM put it after the last trunk layer).
        self.checkpoint_prefix = layout.checkpoint_prefix(text_config)
        self.hidden_first = layout.hidden_first
        self.config = build_mtp_layer_config(text_config, layout)

        norm_class = type(decoder.norm)
        layer_class = type(decoder.layers[-1])
        hidden_size, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.embedding_norm = norm_class(hidden_size, eps=eps)
        self.hidden_norm = norm_class(hidden_size, eps=eps)
        self.projection = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = layer_class(self.config, 0)
        self.final_norm = norm_class(hidden_size, eps=eps)
        if getattr(self.layer, "self_attn", None) is None:
            raise ValueError(f"The MTP layer built from {layer_class.__name__} has no full-attention `self_attn`")

        self.register_buffer("d2t", None)  # a draft vocabulary (`use_draft_vocabulary`); None: the full one
        self.register_buffer("t2d", None)
        self._shared = _SharedTargetModules(
            embed_tokens=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(),
            rotary_emb=getattr(decoder, "rotary_emb", None),
        )

    # ------------------------------------------------------------------------------------------------------------
    # Shared target modules

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's input embedding (shared, not owned)."""
        return self._shared.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        """The target's LM head (shared, not owned)."""
        return self._shared.lm_head

    def logits(self, hidden_states: torch.Tensor, subset: bool = False) -> torch.Tensor:
        """Project MTP outputs ``g`` (``[..., H]``) to vocabulary logits (``[..., V]``) with the target LM head. With
        a draft vocabulary only its rows run: scattered into the vocabulary (``-inf`` elsewhere), or with ``subset``
        the ``[..., draft_vocab]`` logits themselves (training)."""
        if self.d2t is None:
            return self.lm_head(hidden_states.to(self.lm_head.weight.dtype))
        logits = subset_head_logits(self, self.lm_head, hidden_states)
        return logits if subset else scatter_to_vocabulary(self, logits)

    def use_draft_vocabulary(self, size: int | None) -> None:
        """Predict over ``size`` target tokens only (``d2t``/``t2d`` buffers, saved with the head, filled by
        `set_draft_vocabulary` or a checkpoint); ``None``: the full vocabulary. Native heads keep the full one unless
        asked: vLLM and SGLang read no draft vocabulary for MTP heads."""
        register_draft_vocabulary(self, size, self.lm_head.weight.shape[0])

    # ------------------------------------------------------------------------------------------------------------
    # Stateless forward

    def forward(
        self,
        next_token_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        position_ids: torch.LongTensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the MTP layer on n pairs ``(x_{t+1}, h_t)`` and return ``g_t`` after the final norm.

        Usable on its own for teacher-forced passes (training features: ``g_t`` for every position).

        Args:
            next_token_ids: ``[B, n]`` tokens ``x_{t+1}``.
            target_hidden: ``[B, n, H]`` target hidden states ``h_t`` (post- or pre-norm, see ``hidden_input``).
            position_ids: ``[B, n]`` positions of the pairs (the positions ``t`` of ``h_t``).
            cache: KV cache of the MTP layer, updated in place; None for a cache-free pass. Any object with the
                ``Cache.update`` call works (the drafter state's slots); its masks are then the caller's.
            attention_mask: ``[B, past + n]`` 2D padding mask (1 = real pair), or None when nothing is padded; a 4D
                mask is used as given, and so is any mask for a cache that is not a Transformers ``Cache``.

        Returns:
            ``[B, n, H]`` MTP hidden states ``g_t``; ``logits(g_t)`` predicts ``x_{t+2}``.
        """
        embeds = self.embed_tokens(next_token_ids).to(self.projection.weight.dtype)
        hidden = target_hidden.to(self.projection.weight.dtype)
        parts = [self.hidden_norm(hidden), self.embedding_norm(embeds)]
        if not self.hidden_first:
            parts.reverse()
        hidden_states = self.projection(torch.cat(parts, dim=-1))  # [B, n, 2H] -> [B, n, H]

        if (attention_mask is not None and attention_mask.ndim == 4) or not isinstance(cache, (Cache, type(None))):
            mask = attention_mask  # built by the caller for its own storage (None: every key visible)
        else:
            # Only the cache length (query offset) and the padding mask shape it; positions only drive RoPE.
            mask = create_causal_mask(
                config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask, cache=cache
            )
        rotary_emb = self._shared.rotary_emb
        position_embeddings = rotary_emb(hidden_states, position_ids) if rotary_emb is not None else None
        hidden_states = self.layer(
            hidden_states,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )
        if isinstance(hidden_states, tuple):  # older decoder layers return (hidden, ...)
            hidden_states = hidden_states[0]
        return self.final_norm(hidden_states)
