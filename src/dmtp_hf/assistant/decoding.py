"""The speculative decoding loop: prefill, then rounds of draft -> verify -> rollback -> advance (DESIGN.md §2).

Read top to bottom, it is one round of DMTP (or of any drafter in ``drafters.py``):

1. **Draft.** The drafter proposes K candidates after the committed sequence, whose last token A the target has
   not processed yet (DMTP: T1 from the cached MTP hidden -> fusion -> one DFlash forward for T2..T7).
2. **Verify.** One target forward over ``[A, T1..TK]`` at positions ``a .. a+K``, returning logits, the DFlash
   context features and the hidden the MTP head reads.
3. **Accept.** Greedy / match / rejection (``verification.py``): ``n`` accepted candidates plus one bonus token,
   clipped at EOS and at ``max_length``.
4. **Roll back** the target cache to ``a + n`` (crop KV; restore + replay linear-attention states).
5. **Advance** the drafter with the ``n + 1`` committed positions; the MTP head's next output predicts the next
   round's T1.

One host synchronisation per round (reading ``n`` to slice the sequence); none per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache

from ..modeling.native_mtp.hidden import TargetHiddenExtractor
from .drafters import Drafter, TargetStep, TokenSelector
from .rollback import CacheRollback
from .stats import SpecStats
from .verification import VERIFY_MODES, process_block, process_logits, select_tokens, verify


class _TargetRunner:
    """Runs target forwards and extracts what drafters need (features at ``target_layer_ids``, MTP hidden)."""

    def __init__(self, target, drafter: Drafter, cache: Cache) -> None:
        self.target = target
        self.cache = cache
        self.layer_ids = drafter.target_layer_ids() if drafter.needs_features else []
        self.hidden_indices = [i + 1 for i in self.layer_ids]
        self.mtp_extractor = (
            TargetHiddenExtractor(target, getattr(drafter, "hidden_input", "post_norm"))
            if drafter.needs_mtp_hidden
            else None
        )

    def forward(self, input_ids: torch.Tensor, start: int, logits_to_keep: int, capture: bool = True):
        """Target forward over ``input_ids`` at positions ``start ..``; returns (logits, features, mtp_hidden)."""
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        positions = positions.expand(input_ids.shape[0], -1)
        out = self.target(
            input_ids=input_ids,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=(self.hidden_indices or None) if capture else None,
            logits_to_keep=logits_to_keep,
        )
        features = mtp_hidden = None
        if capture and self.hidden_indices:
            features = torch.cat([out.hidden_states[i] for i in self.hidden_indices], dim=-1)
        if capture and self.mtp_extractor is not None:
            mtp_hidden = self.mtp_extractor()
        return out.logits, features, mtp_hidden

    def close(self) -> None:
        if self.mtp_extractor is not None:
            self.mtp_extractor.remove()


def _clip(new_tokens: torch.Tensor, eos: torch.Tensor | None, budget: int) -> torch.Tensor:
    """Keep at most ``budget`` tokens and stop after the first EOS (``new_tokens`` is ``[1, m]``)."""
    new_tokens = new_tokens[:, :budget]
    if eos is not None and eos.numel():
        is_eos = torch.isin(new_tokens[0], eos)
        if bool(is_eos.any()):
            first = int(is_eos.nonzero()[0, 0])
            new_tokens = new_tokens[:, : first + 1]
    return new_tokens


@torch.no_grad()
def speculative_decode(
    target,
    input_ids: torch.Tensor,
    drafter: Drafter,
    *,
    max_length: int,
    do_sample: bool = False,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    eos_token_id: torch.Tensor | None = None,
    cache: Cache | None = None,
    verify_mode: str | None = None,
    draft_sampling: bool | None = None,
    streamer=None,
    stats: SpecStats | None = None,
    profile: bool = False,
    on_round: Callable[[Cache, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Generate after ``input_ids`` (``[1, P]``) with ``drafter``; returns (sequences ``[1, P + new]``, stats).

    Args:
        max_length: total length (prompt included) at which to stop.
        do_sample: sample the target (``match``/``rejection``) instead of greedy decoding.
        logits_processor: applied identically to target and draft scores (temperature/top-k/top-p included).
        stopping_criteria: checked once per round on the whole sequence (as Transformers' assisted decoding does).
        eos_token_id: tokens that end generation; the round's tokens are clipped after the first one.
        cache: the target cache (a fresh ``DynamicCache`` by default; any cache kind is rolled back correctly).
        verify_mode: ``"greedy"`` (default without sampling), ``"match"`` or ``"rejection"`` (default with sampling).
        draft_sampling: sample the candidates from the draft distributions (default: only for ``rejection``).
        streamer: receives the prompt, then every committed chunk (``put``), then ``end()``.
        stats: statistics to append this request to.
        profile: synchronise around stages on CUDA so per-stage times are exact.
        on_round: called as ``on_round(cache, sequence)`` after every round (used by tests to inspect the cache).
    """
    if input_ids.shape[0] != 1:
        raise NotImplementedError("speculative_decode handles one sequence; batched decoding is not supported yet.")
    mode = verify_mode or ("rejection" if do_sample else "greedy")
    if mode not in VERIFY_MODES:
        raise ValueError(f"Unknown verification mode {mode!r}; expected one of {VERIFY_MODES}.")
    if mode != "greedy" and not do_sample:
        raise ValueError(f"verify_mode={mode!r} samples the target: pass do_sample=True.")
    if mode == "greedy" and do_sample:
        raise ValueError("verify_mode='greedy' cannot be combined with do_sample=True; use 'match' or 'rejection'.")
    draft_sampling = (mode == "rejection") if draft_sampling is None else draft_sampling
    select = TokenSelector(logits_processor, draft_sampling)
    cache = cache if cache is not None else DynamicCache(config=target.config)
    stats = stats if stats is not None else SpecStats(drafter.num_candidates, drafter.name)
    request = stats.new_request()
    sync = input_ids.device if profile else None
    runner = _TargetRunner(target, drafter, cache)
    rollback = CacheRollback(cache)
    eos = eos_token_id.to(input_ids.device).flatten() if eos_token_id is not None else None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    try:
        # ---- Prefill: target over the prompt, first token, drafter state over all prompt positions ----------------
        with stats.stage("prefill", sync):
            logits, features, mtp_hidden = runner.forward(input_ids, 0, logits_to_keep=1)
            rollback.trim()
            first = select_tokens(process_logits(logits[:, -1], input_ids, logits_processor), do_sample)
        sequence = torch.cat([input_ids, first[:, None]], dim=1)
        if streamer is not None:
            streamer.put(first.cpu())
        finished = sequence.shape[1] >= max_length or (eos is not None and bool(torch.isin(first, eos).any()))
        if stopping_criteria is not None and not finished:
            finished = bool(stopping_criteria(sequence, None).any())
        if not finished:
            with stats.stage("rollback_advance", sync):
                drafter.start(TargetStep(0, sequence[:, 1:], mtp_hidden, features))

        while not finished:
            anchor_position = sequence.shape[1] - 1  # position a of A, the last emitted token

            # ---- 1. Draft ---------------------------------------------------------------------------------------
            proposal = drafter.propose(sequence, select, stats)
            candidates = proposal.tokens  # [1, K]
            num_candidates = candidates.shape[1]

            # ---- 2. Verify: one target forward over [A, T1..TK] ---------------------------------------------
            with stats.stage("verify", sync):
                rollback.before_verify()
                verify_ids = torch.cat([sequence[:, -1:], candidates], dim=1)
                logits, features, mtp_hidden = runner.forward(verify_ids, anchor_position, logits_to_keep=0)
                target_scores = process_block(logits, sequence, candidates, logits_processor)

                # ---- 3. Accept the longest valid prefix, plus one bonus/correction token ------------------------
                verdict = verify(mode, candidates, target_scores, proposal.scores)
            num_accepted = int(verdict.num_accepted[0])  # the round's single host sync
            committed = torch.cat([candidates[:, :num_accepted], verdict.bonus[:, None]], dim=1)
            committed = _clip(committed, eos, max_length - sequence.shape[1])
            sequence = torch.cat([sequence, committed], dim=1)
            request.rounds += 1
            request.hist[num_accepted] += 1
            request.round_tokens += committed.shape[1]
            if streamer is not None:
                streamer.put(committed[0].cpu())

            finished = sequence.shape[1] >= max_length or (eos is not None and bool(torch.isin(committed, eos).any()))
            if stopping_criteria is not None and not finished:
                finished = bool(stopping_criteria(sequence, None).any())

            # ---- 4. Roll back the target to the committed tokens; 5. advance the drafter -----------------------
            with stats.stage("rollback_advance", sync):
                # A and the accepted candidates become target history (fewer when EOS/length clipped the round)
                kept = committed.shape[1]
                if rollback.after_verify(num_candidates + 1, kept):
                    runner.forward(verify_ids[:, :kept], anchor_position, logits_to_keep=1, capture=False)
                    rollback.trim()
                if on_round is not None:
                    on_round(cache, sequence)
                if not finished:
                    drafter.advance(
                        TargetStep(
                            anchor_position,
                            sequence[:, anchor_position + 1 : anchor_position + 1 + kept],
                            None if mtp_hidden is None else mtp_hidden[:, :kept],
                            None if features is None else features[:, :kept],
                        )
                    )
    finally:
        runner.close()
        if streamer is not None:
            streamer.end()
    return sequence, stats
