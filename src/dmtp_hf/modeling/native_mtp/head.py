"""`NativeMTPHead`: the target's own pretrained MTP layer, with a private KV cache and the decoding-round operations.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask

from .layouts import MTPLayout, build_mtp_layer_config

__all__ = ["HIDDEN_INPUTS", "NativeMTPHead", "greedy_select"]

HIDDEN_INPUTS = ("post_norm", "pre_norm")
HiddenInput = Literal["post_norm", "pre_norm"]


def greedy_select(logits: torch.Tensor) -> torch.Tensor:
    """Default draft selection: ``argmax`` over the vocabulary (``[B, V] -> [B]``)."""
    return logits.argmax(dim=-1)


@dataclass
class _SharedTargetModules:
    """The target modules the head uses without owning them (a plain object, so `nn.Module` does not register
    them: they are not in the head's ``state_dict``, and ``head.to(...)`` does not move the target)."""

    embed_tokens: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module | None


class NativeMTPHead(nn.Module):
    """One native MTP layer of a target model, with its private KV cache and the operations of a decoding round.

    Build it with `load_native_mtp` (which fills the weights from the target's checkpoint); the constructor only
    creates the modules from the target's own classes.

    Args:
        target: The target causal LM (text-only or multimodal wrapper); its embedding, LM head and RoPE are used.
        layout: The family's `MTPLayout` (concat order, config changes for the block).
        hidden_input: Which target hidden state the head is fed: ``"post_norm"`` (default, as vLLM/SGLang/HF:
            ``outputs.hidden_states[-1]``, the tensor fed to ``lm_head``) or ``"pre_norm"`` (the last decoder
            layer's output before the final norm). Only a label here: callers extract the matching tensor with
            `TargetHiddenExtractor`.

    Round API (DESIGN.md §2), with ``h_t`` the target hidden at position t and ``x_{t+1}`` the token at t+1:

    - `consume` (aliases `prefill`, `advance`): feed n pairs, commit them to the cache, remember ``g`` of the last.
    - `predict`: T1 logits from the remembered ``g`` and ``g`` itself (the hidden that predicts T1).
    - `propose`: native MTP-k drafting by chaining the one layer; leaves the committed state unchanged.
    - `reset`: forget the sequence. `crop`: drop committed pairs.
    """

    def __init__(self, target: PreTrainedModel, layout: MTPLayout, *, hidden_input: HiddenInput = "post_norm"):
        super().__init__()
        if hidden_input not in HIDDEN_INPUTS:
            raise ValueError(f"hidden_input must be one of {HIDDEN_INPUTS}, got {hidden_input!r}")
        text_config = target.config.get_text_config(decoder=True)
        decoder = target.get_decoder()
        self.layout = layout
        self.hidden_input = hidden_input
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

        self._shared = _SharedTargetModules(
            embed_tokens=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(),
            rotary_emb=getattr(decoder, "rotary_emb", None),
        )
        self.reset()

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

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project MTP outputs ``g`` (``[..., H]``) to vocabulary logits (``[..., V]``) with the target LM head."""
        return self.lm_head(hidden_states.to(self.lm_head.weight.dtype))

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
            cache: KV cache of the MTP layer, updated in place; None for a cache-free pass.
            attention_mask: ``[B, past + n]`` 2D padding mask (1 = real pair), or None when nothing is padded; a 4D
                mask is used as given (the fixed-slot fast path builds its own over the whole slot buffer).

        Returns:
            ``[B, n, H]`` MTP hidden states ``g_t``; ``logits(g_t)`` predicts ``x_{t+2}``.
        """
        embeds = self.embed_tokens(next_token_ids).to(self.projection.weight.dtype)
        hidden = target_hidden.to(self.projection.weight.dtype)
        parts = [self.hidden_norm(hidden), self.embedding_norm(embeds)]
        if not self.hidden_first:
            parts.reverse()
        hidden_states = self.projection(torch.cat(parts, dim=-1))  # [B, n, 2H] -> [B, n, H]

        if attention_mask is not None and attention_mask.ndim == 4:
            mask = attention_mask  # already built for the attention kernel (fixed-slot fast path)
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

    # ------------------------------------------------------------------------------------------------------------
    # Decoding-round state

    def reset(self) -> None:
        """Forget the current sequence(s): empty cache, no remembered ``g``; the next `consume` starts afresh."""
        self.cache: DynamicCache | None = None
        self._last_hidden: torch.Tensor | None = None  # [B, H] g of the last committed pair
        self._next_position: torch.Tensor | None = None  # [B] position of the next pair
        self._pair_mask: torch.Tensor | None = None  # [B, committed] padding mask, None while nothing is padded

    @property
    def num_committed(self) -> int:
        """Number of pairs in the MTP cache (padding slots included when batches were padded)."""
        return 0 if self.cache is None else self.cache.get_seq_length()

    def _positions(self, position_ids: torch.Tensor | int | None, batch_size: int, length: int, device) -> torch.Tensor:
        offsets = torch.arange(length, device=device)
        if position_ids is None:
            if self._next_position is None:
                return offsets.expand(batch_size, length)
            return self._next_position[:, None] + offsets
        if isinstance(position_ids, int):
            return (offsets + position_ids).expand(batch_size, length)
        if position_ids.ndim == 1:
            position_ids = position_ids.expand(batch_size, -1)
        return position_ids.to(device)

    def consume(
        self,
        next_token_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed n verified pairs ``(x_{t+1}, h_t)``, commit them to the MTP cache, and remember ``g`` of the last.

        At prefill the pairs are the whole prompt (``x_1 .. x_L`` with ``h_0 .. h_{L-1}``, where ``x_L`` is the
        first emitted token); after a verify they are the ``n_accepted + 1`` new tokens (accepted drafts, then the
        bonus token) with the target hidden states of the verify positions that produced them.

        Args:
            next_token_ids: ``[B, n]`` tokens ``x_{t+1}``.
            target_hidden: ``[B, n, H]`` target hidden states ``h_t``.
            position_ids: ``[B, n]`` (or ``[n]``) positions ``t``; an int is the position of the first pair; None
                continues after the last committed pair (0 for a fresh sequence).
            attention_mask: ``[B, n]`` validity of the new pairs (1 = real, 0 = padding) for padded batches. Padding
                slots stay in the cache but are masked out for all later pairs; ``g`` and the next position are
                taken from each row's last real pair (rows without a real pair keep their previous state).

        Returns:
            ``[B, n, H]`` the MTP hidden ``g_t`` of every pair.
        """
        batch_size, length = next_token_ids.shape
        device = next_token_ids.device
        positions = self._positions(position_ids, batch_size, length, device)
        if self.cache is None:
            self.cache = DynamicCache(config=self.config)

        full_mask = None
        if attention_mask is not None or self._pair_mask is not None:
            past = self._pair_mask
            if past is None:
                past = torch.ones(batch_size, self.num_committed, dtype=torch.long, device=device)
            new = attention_mask if attention_mask is not None else torch.ones_like(next_token_ids)
            full_mask = torch.cat([past, new.to(device=device, dtype=past.dtype)], dim=-1)

        hidden = self.forward(next_token_ids, target_hidden, positions, cache=self.cache, attention_mask=full_mask)
        self._pair_mask = full_mask

        if attention_mask is None:
            self._last_hidden = hidden[:, -1]
            self._next_position = positions[:, -1] + 1
        else:
            # Each row's last real pair (no host sync): index of the last 1 in the row, -1 when the row has none.
            valid = attention_mask.to(device).bool()
            last = torch.where(valid, torch.arange(length, device=device), -1).amax(dim=-1)  # [B]
            has_pair = last >= 0
            index = last.clamp(min=0)
            new_hidden = hidden.gather(1, index[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
            new_position = positions.gather(1, index[:, None])[:, 0] + 1
            if self._last_hidden is None:
                self._last_hidden, self._next_position = new_hidden, new_position
            else:
                self._last_hidden = torch.where(has_pair[:, None], new_hidden, self._last_hidden)
                self._next_position = torch.where(has_pair, new_position, self._next_position)
        return hidden

    def prefill(
        self,
        next_token_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Start a new sequence and consume all prompt pairs (`reset` + `consume`)."""
        self.reset()
        return self.consume(next_token_ids, target_hidden, position_ids, attention_mask)

    def advance(
        self,
        next_token_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Consume the ``n_accepted + 1`` pairs a verify step committed (same as `consume`)."""
        return self.consume(next_token_ids, target_hidden, position_ids, attention_mask)

    def _require_state(self) -> torch.Tensor:
        if self._last_hidden is None:
            raise RuntimeError("NativeMTPHead has no committed pair: call `prefill`/`consume` first")
        return self._last_hidden

    def predict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 logits ``[B, V]`` from the remembered ``g`` (via the target LM head), and ``g`` ``[B, H]`` itself.

        ``g`` is the MTP hidden that *predicts* T1 (the input of the LM head), never one obtained after consuming
        T1; it is what the DMTP fusion conditions on.
        """
        hidden = self._require_state()
        return self.logits(hidden), hidden

    @torch.no_grad()
    def propose(
        self, num_tokens: int, select: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Native MTP-k drafting: chain the one MTP layer ``num_tokens`` times, as vLLM/SGLang do.

        Step 1 is `predict`. Each later step feeds the pair (previous draft, previous step's ``g``) at position +1.
        The temporary cache entries of the chained steps are cropped afterwards, so the committed state (cache,
        ``g``, next position) is exactly what it was before the call.

        Args:
            num_tokens: Number of draft tokens k (>= 1).
            select: Maps logits ``[B, V]`` to tokens ``[B]`` (default: argmax). A sampler must apply its own
                logits processors; the returned logits are the raw LM-head logits.

        Returns:
            ``(draft_ids [B, k], draft_logits [B, k, V])``.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        select = select or greedy_select
        hidden = self._require_state()
        position = self._next_position - 1  # [B] position of the last committed pair
        step_logits = self.logits(hidden)
        token = select(step_logits)
        tokens, logits = [token], [step_logits]
        mask = self._pair_mask
        committed = self.num_committed
        try:
            for step in range(1, num_tokens):
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
                hidden = self.forward(
                    token[:, None], hidden[:, None], (position + step)[:, None], cache=self.cache, attention_mask=mask
                )[:, 0]
                step_logits = self.logits(hidden)
                token = select(step_logits)
                tokens.append(token)
                logits.append(step_logits)
        finally:
            # Roll back the chained steps' temporary entries: only verified history stays committed.
            if self.num_committed > committed:
                self.cache.crop(committed - self.num_committed)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (``[B']`` indices), e.g. when finished sequences leave a batch."""
        if self.cache is not None:
            self.cache.reorder_cache(rows)
        for name in ("_last_hidden", "_next_position", "_pair_mask"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, rows.to(value.device)))

    def crop(self, num_pairs: int) -> None:
        """Drop the last ``num_pairs`` committed pairs from the cache (and padding mask).

        The remembered ``g`` belonged to the last dropped pair, so it is forgotten: `consume` the replacement pairs
        before calling `predict`/`propose` again.
        """
        if num_pairs <= 0:
            return
        if self.cache is None or num_pairs > self.num_committed:
            raise ValueError(f"Cannot crop {num_pairs} pairs from an MTP cache holding {self.num_committed}")
        self.cache.crop(-num_pairs)
        if self._pair_mask is not None:
            self._pair_mask = self._pair_mask[:, :-num_pairs]
        if self._next_position is not None:
            self._next_position = self._next_position - num_pairs
        self._last_hidden = None
