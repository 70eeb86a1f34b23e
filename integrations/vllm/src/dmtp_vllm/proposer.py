"""The DMTP round in vLLM: T1 from the MTP head, then one DFlash block conditioned on it.

vLLM calls ``propose`` once per engine step, after the target verified the previous proposals, with the tokens
the target just processed (``target_token_ids``/``target_positions``, in padded mode the rejected ones too), their
captured hidden states, and each request's bonus token (``next_token_ids``). For every request at once:

1. **T1.** The MTP head consumes the new pairs ``(x_{t+1}, h_t)``: the processed tokens shifted by one, the bonus
   in the last valid slot, the target's final hidden at t (the last captured layer, through the target's final
   norm). This is vLLM's own EAGLE first pass, with the target's (causal) attention metadata: the head's K/V land in
   its paged cache at those positions, and its output at the last valid slot is ``g``, whose argmax is T1. Rejected
   slots are written too and overwritten once those positions hold real tokens, as for every vLLM drafter.
2. **The block.** vLLM's DFlash pass (`DFlashProposer`): the context K/V of the processed positions from the
   captured feature layers, then one non-causal pass over ``[bonus, T1 slot, MASK x (K-1)]``, where the T1 slot's
   input is ``fusion(E(T1), g)`` (T1's id in the slot, the fusion's residual added to its embedding).
3. **Proposals.** ``[T1, block slots 2..K]``: K = ``num_speculative_tokens`` (7 for drafts trained with 8-slot
   blocks). vLLM's rejection sampler verifies them, so the output is the target's (greedy: token-identical).

Draft tokens are greedy (vLLM's default ``draft_sample_method``); the probabilistic draft method would need T1's
``q`` next to the block's, which is not wired yet and is refused at start.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from .model import DFlashDMTPDraftModel

__all__ = ["DMTPProposer"]


class DMTPProposer(DFlashProposer):
    """vLLM's DFlash proposer with the MTP head's T1 in front of the block (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        spec = vllm_config.speculative_config
        if spec.draft_sample_method == "probabilistic":
            raise NotImplementedError("dmtp-vllm drafts greedily: leave draft_sample_method at 'greedy'")
        candidates = self.draft_model_config.hf_config.dmtp_config["num_candidates"]
        if not 2 <= spec.num_speculative_tokens <= candidates:
            raise ValueError(
                f"num_speculative_tokens must lie in 2..{candidates} for this DMTP draft (T1 plus block slots it "
                f"was trained for), got {spec.num_speculative_tokens}"
            )
        self._first_candidate: tuple[torch.Tensor, torch.Tensor] | None = None  # (T1 [B], g [B, H]) of this step

    def load_model(self, target_model: torch.nn.Module) -> None:
        """vLLM's draft loading (embedding shared with the target), plus the target modules the head reads."""
        super().load_model(target_model)
        if not isinstance(self.model, DFlashDMTPDraftModel):
            raise TypeError(f"DMTPProposer needs a {DFlashDMTPDraftModel.__name__} draft, got {type(self.model)}")
        language_model = target_model.get_language_model() if hasattr(target_model, "get_language_model") else None
        language_model = language_model or target_model
        self._target_final_norm = language_model.model.norm
        self._target_lm_head = language_model.lm_head

    @torch.inference_mode()
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [N] tokens the target just processed
        target_positions: torch.Tensor,  # [N]
        target_hidden_states: torch.Tensor,  # [N, (k + 1) * H]: k feature layers, then the last layer's output
        next_token_ids: torch.Tensor,  # [B] the bonus token of each request
        token_indices_to_sample: torch.Tensor | None,  # [B] last valid slot of each request (padded mode)
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        """``[B, K]`` proposals: T1, then the block's slots 2..K."""
        width = self.model.context_width
        context, last_layer = target_hidden_states[:, :width], target_hidden_states[:, width:]
        t1, g = self._propose_first_candidate(
            target_token_ids,
            target_positions,
            last_layer,
            next_token_ids,
            token_indices_to_sample,
            common_attn_metadata,
        )
        self._first_candidate = (t1, g)
        try:
            proposals = super().propose(
                num_speculative_tokens,
                target_token_ids,
                target_positions,
                context,
                next_token_ids,
                token_indices_to_sample,
                common_attn_metadata,
                sampling_metadata,
                mm_embed_inputs,
                num_rejected_tokens_gpu,
                slot_mappings,
            )
        finally:
            self._first_candidate = None
        proposals[:, 0] = t1  # the block's own guess at T1's slot is not a proposal: its input was T1
        return proposals

    def _propose_first_candidate(
        self,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        last_layer: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 of the module docstring: ``(T1 [B], g [B, H])``."""
        head = self.model.mtp
        # The head reads the hidden fed to the LM head (post-norm) unless trained on the pre-norm one.
        hidden = self._target_final_norm(last_layer) if self.model.mtp_hidden_input == "post_norm" else last_layer
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1:] - 1
        pair_tokens = torch.zeros_like(target_token_ids)  # x_{t+1} of the pair at t (0 past the last request)
        pair_tokens[:-1] = target_token_ids[1:]
        pair_tokens[token_indices_to_sample] = next_token_ids.to(pair_tokens.dtype)
        num_tokens = target_token_ids.shape[0]
        # The target's causal metadata over these positions; the base (EAGLE) builder, not DFlash's non-causal one.
        _, per_layer = SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata(self, cad)
        slots = cad.slot_mapping[:num_tokens]
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=num_tokens,
            slot_mapping={name: slots for name in self._draft_attn_layer_names},
        ):
            g = head(self.model.model.embed_tokens(pair_tokens), hidden, target_positions)  # [N, H]
        g = g[token_indices_to_sample]  # [B, H]: predicts the token after each bonus
        return head.greedy(g, self._target_lm_head), g

    def set_inputs_first_pass(self, *args: Any, **kwargs: Any) -> tuple[int, torch.Tensor, Any]:
        """DFlash's block inputs, then every request's T1 slot: T1's id, and the fusion residual of ``(E(T1), g)``
        in the block model's ``slot_residual`` (zero on every other row)."""
        num_tokens, token_indices_to_sample, cad = super().set_inputs_first_pass(*args, **kwargs)
        assert self._first_candidate is not None
        t1, g = self._first_candidate
        block = self.model.model
        rows = torch.arange(t1.shape[0], device=t1.device) * (1 + self.num_speculative_tokens) + 1  # [B]
        self.input_ids[rows] = t1.to(self.input_ids.dtype)
        block.slot_residual[:num_tokens].zero_()
        if self.model.fusion is not None:
            block.slot_residual[rows] = self.model.fusion.residual(block.embed_tokens(t1), g).to(
                block.slot_residual.dtype
            )
        return num_tokens, token_indices_to_sample, cad
