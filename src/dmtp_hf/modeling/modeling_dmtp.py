"""The DMTP draft model: a DFlash backbone plus the first-candidate (T1) fusion.

Read top to bottom:

1. ``DMTPAttention`` / ``DMTPDecoderLayer``: Qwen3 decoder layers whose K/V are ``[context ; block]``: the
   projected target features are injected as extra keys/values in every layer, the block attends to itself
   bidirectionally (causally in sliding layers unless ``is_causal`` says otherwise). Who may attend to whom is
   one rule, ``dflash_visibility`` in ``attention_masks.py``.
2. ``DMTPDraftModel``: the checkpoint. ``forward`` runs the backbone on already-embedded slots;
   ``block_embeddings`` builds the slots of a round for the configured layout, T1's slot through the fusion
   (``fusion.py``); ``bind`` attaches the target (``binding.py``: its embedding and LM head are used, never copied).

Shapes: ``B`` batch, ``Q`` block slots, ``C`` context positions, ``H`` hidden size, ``k`` target feature layers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .attention_masks import layer_kinds, one_block_masks, pad_keys_to_block_mask
from .binding import UNBOUND_ASSISTANT, bind_draft, bound_native_mtp
from .configuration_dmtp import DMTPConfig, check_config_keys, require_local_directory
from .dflash2 import CandidateSelector, GroupedDynamicCausalConv
from .draft_vocab import draft_logits, register_draft_vocabulary
from .engine_export import dflash_state_dict
from .fusion import FirstCandidateFusion
from .io import check_finite, check_loading_info, save_dflash_checkpoint
from .validation import check_checkpoint_tensors

# ----------------------------------------------------------------------------------------------------
# 1. Backbone (visibility: attention_masks.py)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DMTPRotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's RoPE whose frequencies stay float32 whatever the draft is cast to.

    ``draft.to(torch.bfloat16)`` would otherwise cast ``inv_freq`` too: about 0.2 rad of angle error at distance
    500 and 1.7 rad at 4,000, which DFlash queries (they attend over the whole context) pay in acceptance.
    """

    def _apply(self, fn, recurse=True):
        exact = {name: getattr(self, name) for name in ("inv_freq", "original_inv_freq")}
        super()._apply(fn, recurse)
        for name, value in exact.items():  # follow the move, never the cast
            setattr(self, name, value.to(device=getattr(self, name).device, dtype=torch.float32))
        return self


class DMTPAttention(nn.Module):
    """Qwen3 attention whose keys/values are ``[context ; block]``, with the same projections for both.

    The context vectors (projected target features) skip the layer norm and the MLP: they only provide K/V.
    Only context K/V are cached: block K/V are recomputed every round, so the cache never holds draft tokens.
    """

    def __init__(self, config: DMTPConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        sliding = self.layer_type == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        # Newest DFlash rule: top-level `is_causal` wins, else sliding layers are causal within the block.
        self.block_causal = config.is_causal if config.is_causal is not None else sliding
        self.is_causal = False  # read by HF attention kernels: never a plain causal mask
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, Q, H] normed block slots
        context: torch.Tensor | None,  # [B, C_new, H] projected target features (new positions only)
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos/sin for [C_new + Q] positions
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        kv_input = hidden_states if context is None else torch.cat([context, hidden_states], dim=1)
        kv_len = kv_input.shape[1]

        query = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(bsz, kv_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(bsz, kv_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query = _apply_rope(query, cos[:, -q_len:], sin[:, -q_len:])
        key = _apply_rope(key, cos, sin)

        if cache is not None:
            # Persist only the context part; the block part is appended locally.
            ctx_len = kv_len - q_len
            ctx_key, ctx_value = cache.update(key[:, :, :ctx_len], value[:, :, :ctx_len], self.layer_idx)
            key = torch.cat([ctx_key, key[:, :, ctx_len:]], dim=2)
            value = torch.cat([ctx_value, value[:, :, ctx_len:]], dim=2)

        key, value = pad_keys_to_block_mask(key, value, attention_mask)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            is_causal=False,
            **kwargs,
        )
        attn_output = attn_output.reshape(bsz, q_len, -1).contiguous()
        return self.o_proj(attn_output)


class DMTPDecoderLayer(GradientCheckpointingLayer):
    """A Qwen3 pre-norm decoder layer whose attention also reads the target context as K/V. The DFlash2 backbone
    wraps each sublayer in a grouped dynamic causal convolution along the block (``dflash2.py``)."""

    def __init__(self, config: DMTPConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DMTPAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        dflash2 = config.backbone == "dflash2"
        self.attention_conv = GroupedDynamicCausalConv(config) if dflash2 else None
        self.mlp_conv = GroupedDynamicCausalConv(config) if dflash2 else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        if self.attention_conv is not None:
            normed, dynamic = self.attention_conv.prepare(normed)
        out = self.self_attn(normed, context, position_embeddings, attention_mask, cache=cache, **kwargs)
        if self.attention_conv is not None:
            out = self.attention_conv.finish(out, dynamic)
        hidden_states = hidden_states + out
        normed = self.post_attention_layernorm(hidden_states)
        if self.mlp_conv is not None:
            normed, dynamic = self.mlp_conv.prepare(normed)
        out = self.mlp(normed)
        if self.mlp_conv is not None:
            out = self.mlp_conv.finish(out, dynamic)
        return hidden_states + out


# ----------------------------------------------------------------------------------------------------
# 2. The checkpoint


class DMTPPreTrainedModel(PreTrainedModel):
    """Weight initialisation and HF capabilities shared by DMTP models."""

    config_class = DMTPConfig
    config: DMTPConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DMTPDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # DFlash checkpoints sometimes ship copies of the target's embedding/LM head (e.g. early Qwen3.6 previews).
    _keys_to_ignore_on_load_unexpected = [
        r"(^|\.)embed_tokens\.weight$",
        r"(^|\.)lm_head\.weight$",
        r"rotary_emb",
    ]

    def _init_weights(self, module: nn.Module) -> None:
        special = getattr(module, "_dmtp_init", None)
        if isinstance(module, GroupedDynamicCausalConv):  # DFlash2 starts as DFlash: identity convolutions
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):  # and a walk that picks the argmax (zero transitions)
            init.normal_(module.predecessor_codebook, std=self.config.initializer_range)
            init.zeros_(module.successor_codebook)
        elif special == "zeros":  # residual fusions start as an exact no-op
            init.zeros_(module.weight)
        elif special == "pass_embedding":  # 'replace' starts as RMS_e(E(T1)): identity on the embedding half
            hidden = module.weight.shape[0]
            eye = torch.zeros(module.weight.shape, dtype=module.weight.dtype, device=module.weight.device)
            eye[:, :hidden] = torch.eye(hidden, dtype=eye.dtype, device=eye.device)
            init.copy_(module.weight, eye)
        else:
            super()._init_weights(module)


class DMTPDraftModel(DMTPPreTrainedModel):
    """DFlash-style parallel drafter conditioned on the native MTP head's first candidate.

    The model owns no embedding and no LM head: it uses the bound target's (see :meth:`bind`). Keys are
    unprefixed, as in DFlash checkpoints: ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm`` and ``fusion.*``.

    Example:

    ```python
    target = AutoModelForCausalLM.from_pretrained(target_path)
    draft = DMTPDraftModel.from_pretrained(draft_path, target=target)
    block = draft.block_embeddings(anchor_ids, t1_ids, mtp_hidden)              # [B, 8, H]
    hidden = draft(block, context_features, position_ids, cache=cache).last_hidden_state
    logits = draft.compute_logits(hidden[:, draft.config.first_predicted_slot :])  # T2..T7
    ```
    """

    def __init__(self, config: DMTPConfig):
        super().__init__(config)
        config.validate_dmtp()
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_context_features * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DMTPDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = DMTPRotaryEmbedding(config=config)
        self.fusion = FirstCandidateFusion(config) if config.anchor_layout != "dflash" else None
        self.candidate_selector = CandidateSelector(config) if config.backbone == "dflash2" else None
        register_draft_vocabulary(self, config.draft_vocab_size, config.vocab_size)  # d2t / t2d, or None
        # What a checkpoint may lack, initialised as documented instead (the one place this is decided: Transformers
        # drops these from the loading report): the fusion of a DFlash checkpoint, DFlash2's parts of a DFlash one.
        excused = [r"^fusion\."] if self.fusion is not None and config.checkpoint_without_fusion else []
        if config.checkpoint_without_dflash2:
            excused += [r"^candidate_selector\.", r"\.(attention|mlp)_conv\."]
        if excused:
            self._keys_to_ignore_on_load_missing = excused
        self.__dict__.update(_target=None, _native_mtp=None, _native_mtp_missing=None)  # see `bind`
        self.gradient_checkpointing = False
        self.post_init()

    # ------------------------------------------------------------------------------------------------------------
    # Target binding

    @property
    def target(self) -> nn.Module:
        """The bound target model (not a submodule: it is neither saved nor moved with the draft)."""
        if self._target is None:
            raise RuntimeError("This DMTP draft is not bound to a target; call `draft.bind(target)` first.")
        return self._target

    def bind(self, target: nn.Module, native_mtp: nn.Module | None = None) -> DMTPDraftModel:
        """Attach the target whose frozen embedding, LM head and native MTP head the draft uses (``binding.py``).

        Checks compatibility first and raises ``ValueError`` naming the mismatch: hidden size, vocabulary,
        ``target_layer_ids`` out of range, ``num_target_layers`` different from the target's depth, or a mask token
        outside the target embedding. ``native_mtp`` defaults to the head in the target's own checkpoint (read now,
        for layouts with a T1 slot). The draft is cast to the target's floating-point dtype.
        """
        bind_draft(self, target, native_mtp)
        return self

    @property
    def native_mtp(self) -> nn.Module:
        """The native MTP head bound with the target (see :meth:`bind`)."""
        return bound_native_mtp(self)

    def __getattr__(self, name: str):
        if name == "generation_config":  # read by Transformers' own assisted loop: a draft that was never bound
            raise AttributeError(UNBOUND_ASSISTANT)
        return super().__getattr__(name)

    @property
    def target_embedding(self) -> nn.Module:
        """The target's input embedding."""
        return self.target.get_input_embeddings()

    @property
    def target_head(self) -> nn.Module:
        """The target's output head."""
        return self.target.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module | None:
        """The bound target's embedding, or ``None`` when unbound (the draft has none of its own)."""
        return self._target.get_input_embeddings() if self._target is not None else None

    # ------------------------------------------------------------------------------------------------------------
    # Inputs and outputs of a round

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``input_ids`` times ``dflash_config.input_embedding_scale`` (default 1)."""
        # In the draft's dtype: the same as the target's at inference (bind casts), fp32 masters in training
        embeds = self.target_embedding(input_ids).to(self.norm.weight.dtype)
        scale = self.config.dflash_config.get("input_embedding_scale")
        return embeds * scale if scale not in (None, 1, 1.0) else embeds

    def compute_logits(self, hidden_states: torch.Tensor, subset: bool = False) -> torch.Tensor:
        """Draft logits through the target LM head (DFlash's multiplier and softcap; a draft vocabulary's rows only,
        scattered into the full vocabulary unless ``subset``): `draft_vocab.draft_logits`."""
        return draft_logits(self, self.target_head, hidden_states, subset)

    def block_embeddings(
        self,
        anchor_ids: torch.Tensor,  # [B]   A, the last emitted token
        t1_ids: torch.Tensor | None = None,  # [B]   T1 from the MTP head (unused by 'dflash')
        mtp_hidden: torch.Tensor | None = None,  # [B, H_mtp] the MTP hidden that predicted T1
    ) -> torch.Tensor:
        """The input slots of one drafting block for the configured layout, ``[B, block_length, H]``.

        ``dflash``: ``[E(A), E(MASK) x n]``; ``single``: ``[fuse(E(T1)), E(MASK) x (n-1)]``;
        ``dual``: ``[E(A), fuse(E(T1)), E(MASK) x (n-1)]``.
        """
        layout, n = self.config.anchor_layout, self.config.num_candidates
        num_masks = n if layout == "dflash" else n - 1
        mask_ids = torch.full(
            (anchor_ids.shape[0], num_masks),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_ids.device,
        )
        if layout == "dflash":
            return self.embed(torch.cat([anchor_ids[:, None], mask_ids], dim=1))
        if t1_ids is None:
            raise ValueError(f"anchor_layout={layout!r} needs the first candidate T1.")
        lead = [anchor_ids[:, None], t1_ids[:, None]] if layout == "dual" else [t1_ids[:, None]]
        embeds = self.embed(torch.cat([*lead, mask_ids], dim=1))
        t1_slot = 1 if layout == "dual" else 0
        fused_t1 = self.fusion(embeds[:, t1_slot], mtp_hidden)
        return torch.cat([embeds[:, :t1_slot], fused_t1[:, None], embeds[:, t1_slot + 1 :]], dim=1)

    def block_position_ids(self, anchor_positions: torch.Tensor) -> torch.Tensor:
        """Absolute positions of the block slots, ``[B, block_length]``, given A's position ``[B]``
        (`block_slot_positions`)."""
        return block_slot_positions(anchor_positions, self.config)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """``[B, C, k*H]`` concatenated target hidden states -> ``hidden_norm(fc(.))`` ``[B, C, H]``."""
        expected = self.fc.in_features
        if context_features.shape[-1] != expected:
            raise ValueError(
                f"context_features has width {context_features.shape[-1]} but fc expects {expected} "
                f"({self.config.num_context_features} target layers x hidden {self.config.hidden_size})."
            )
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    # ------------------------------------------------------------------------------------------------------------
    # Forward

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        context_features: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict[str, Any] | None = None,
        cache: Cache | None = None,
        use_cache: bool = False,
        context_is_projected: bool = False,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Run the backbone on block slots.

        Args:
            inputs_embeds: ``[B, Q, H]`` block slot embeddings (see :meth:`block_embeddings`).
            context_features: ``[B, C_new, k*H]`` target features of positions not yet in ``cache`` (or ``None``).
            position_ids: ``[B, C_new + Q]`` absolute positions of the new context followed by the block slots.
            attention_mask: ``None`` (one block that sees every context entry, all strictly before A, and itself;
                cached entries sit at positions ``0 .. C_cached - 1``; sliding windows applied), a mask ready for the
                attention kernel, or a dict ``{"full_attention": m, "sliding_attention": m}``
                (``attention_masks.draft_attention_masks`` builds them for any layout).
            cache: a :class:`~transformers.DynamicCache` (or the drafter state's slots) holding context K/V only.
            use_cache: create a cache when ``cache`` is ``None``.
            context_is_projected: ``context_features`` already went through :meth:`project_context`.

        Returns:
            ``BaseModelOutputWithPast`` whose ``last_hidden_state`` is the final-normed ``[B, Q, H]``.
        """
        if use_cache and cache is None:
            cache = DynamicCache()
        q_len = inputs_embeds.shape[1]
        context = None
        if context_features is not None and context_features.shape[1] > 0:
            context = context_features if context_is_projected else self.project_context(context_features)
            context = context.to(inputs_embeds.dtype)
        c_new = 0 if context is None else context.shape[1]
        if position_ids is None:
            raise ValueError("position_ids ([B, C_new + Q], absolute positions shared with the target) are required.")
        if position_ids.shape[-1] != c_new + q_len:
            raise ValueError(
                f"position_ids covers {position_ids.shape[-1]} positions but the forward has {c_new} new context "
                f"positions + {q_len} block slots."
            )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        if isinstance(attention_mask, dict):
            masks = attention_mask
        elif attention_mask is not None:
            masks = {"full_attention": attention_mask, "sliding_attention": attention_mask}
        else:
            cached = cache.get_seq_length() if cache is not None else 0
            masks = one_block_masks(
                position_ids,
                c_new,
                cached,
                layer_kinds(self.layers),
                self.config._attn_implementation,
                inputs_embeds.dtype,
            )

        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                context,
                position_embeddings,
                masks[layer.self_attn.layer_type],
                cache=cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)

    # ------------------------------------------------------------------------------------------------------------
    # Loading and saving

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args: Any,
        target: nn.Module | None = None,
        native_mtp: nn.Module | None = None,
        **kwargs: Any,
    ) -> DMTPDraftModel:
        """Load a DMTP checkpoint or an unmodified DFlash checkpoint, strictly.

        A DFlash checkpoint (``architectures: ["DFlashDraftModel"]``, no ``dmtp_config``) loads as DFlash with
        ``block_size - 1`` candidates; with ``anchor_layout="dual"`` its fusion starts at zero, exactly "DFlash
        conditioned on T1". Config fields can be overridden as keyword arguments (``num_candidates=7``; a misspelt
        one raises ``ValueError`` with the field it resembles). Any other missing, unexpected, mis-shaped or
        integer-stored float tensor raises ``ValueError`` naming it. ``target`` binds the draft (see :meth:`bind`)
        and must own any ``embed_tokens``/``lm_head`` copy stored; ``native_mtp`` is the MTP head to bind with it
        (default: the target's own). A layout with a T1 slot (``single``/``dual``) needs a head: bound to a target
        that ships none, without ``native_mtp``, loading raises ``ValueError`` saying how to get one.
        """
        require_local_directory(pretrained_model_name_or_path)
        if native_mtp is not None and target is None:
            raise ValueError("native_mtp= is bound together with its target: pass target= too.")
        check_config_keys(kwargs, "keyword argument")  # with `config=` given, no config loading would check them
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("key_mapping", {r"^model\.": ""})
        # Let HF report mismatched shapes instead of raising, so the error below can name the tensors.
        kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        check_loading_info(info)
        check_finite(model.state_dict().items(), f"The checkpoint {pretrained_model_name_or_path}")
        if target is not None:
            model.bind(target, native_mtp)
            _require_bound_head(model, target, pretrained_model_name_or_path)
        check_checkpoint_tensors(model, pretrained_model_name_or_path, kwargs, target)  # after bind's own checks
        return (model, info) if want_info else model

    def save_dflash(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the backbone in the z-lab layout (``DFlashDraftModel`` or ``DFlash2DraftModel``, no ``fusion.*``).

        Refuses unless the fusion is an exact no-op (zero residual), since the DFlash layout cannot hold it. A draft
        vocabulary's LM head rows are written as ``lm_head.weight`` (engines read a subset's head from the draft
        folder), which needs the draft bound to its target.
        """
        if self.fusion is not None and not self.fusion.is_noop():
            raise ValueError(
                "This draft has trained fusion weights; the DFlash layout cannot store them. "
                "Use save_pretrained() for the DMTP layout."
            )
        save_dflash_checkpoint(dflash_state_dict(self), self.config.to_dflash_dict(), save_directory, **kwargs)


def block_slot_positions(anchor_positions: torch.Tensor, config: DMTPConfig) -> torch.Tensor:
    """The absolute position of every slot of a drafting block, ``[..., block_length]``, given the positions of the
    blocks' anchors A ``[...]`` (any shape: one block per row at inference, ``[B, N]`` blocks in training) and the
    layout's block (``single`` starts at A + 1, ``dflash``/``dual`` at A itself: ``config.block_offset``)."""
    offsets = torch.arange(config.block_length, device=anchor_positions.device)
    return anchor_positions[..., None] + config.block_offset + offsets


def _require_bound_head(draft: DMTPDraftModel, target: nn.Module, path: str | os.PathLike) -> None:
    """Refuse, at load, a draft with a T1 slot bound to a target without an MTP head: the first round would fail."""
    config = draft.config
    if config.anchor_layout == "dflash" or draft.__dict__.get("_native_mtp") is not None:
        return
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    reason = draft.__dict__.get("_native_mtp_missing")
    head = "that retrofitted head" if config.dmtp_config.get("mtp_source") == "retrofit" else "a trained head"
    if config.checkpoint_without_fusion:  # e.g. a DFlash checkpoint asked for as DMTP
        dflash = "load it without anchor_layout= (or anchor_layout='dflash'): the checkpoint is a DFlash draft"
    else:
        dflash = "use a DFlash draft (anchor_layout='dflash'), which needs no head"
    raise ValueError(
        f"{path}: this draft (anchor_layout={config.anchor_layout!r}) drafts after the first candidate of an MTP "
        f"head, but the target {type(target).__name__} (model_type {text.model_type!r}) has no native MTP head"
        + (f" ({' '.join(str(reason).split())})" if reason else "")
        + f". Either pass {head}: DMTPDraftModel.from_pretrained(path, target=target, "
        "native_mtp=load_native_mtp(target, checkpoint=HEAD_DIR)) (`dmtp train` with train_mtp_head: only and "
        f"mtp_retrofit: true trains one for a target that ships none), or {dflash}."
    )


__all__ = ["DMTPDraftModel", "DMTPPreTrainedModel", "FirstCandidateFusion", "block_slot_positions"]
