"""The speculative decoding loop: prefill, then rounds of draft -> verify -> accept -> commit (DESIGN.md §2).

Read top to bottom, it is one round of DMTP (or of any drafter in ``drafters.py``) for a batch of B rows:

1. **Draft.** The drafter proposes K candidates per row after the committed tokens, whose last token A the target
   has not processed yet (DMTP: T1 from the cached MTP hidden -> fusion -> one DFlash forward for T2..T7).
2. **Verify.** One target forward over ``[A, T1..TK]`` at each row's positions ``a .. a+K``, returning logits, the
   DFlash context features and the hidden the MTP head reads.
3. **Accept.** Greedy / match / rejection (``verification.py``): ``n`` accepted candidates plus one bonus token
   per row, clipped at EOS and at the row's token budget.
4. **Commit** the target cache to ``a + n`` per row (``target_state.py``: masks for ragged attention KV, the
   per-step state of linear-attention layers; or restore + replay at batch size 1).
5. **Advance** the drafter with the committed positions; the MTP head's next output predicts the next T1.

Rows that finish (EOS, budget, stopping criteria) stop committing; the batch keeps its shape. Host
synchronisations happen a few times per round (acceptance counts, finished flags, whether masks are needed),
never per token or per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..modeling.native_mtp.hidden import TargetHiddenExtractor
from .drafters import Drafter, TargetStep, TokenSelector
from .stats import SpecStats
from .target_state import TargetCacheState, static_capacity
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

    def forward(self, input_ids, positions, attention_mask=None, logits_to_keep: int = 0, capture: bool = True):
        """Target forward over ``input_ids`` ``[B, q]`` at ``positions`` ``[B, q]``: (logits, features, mtp_hidden)."""
        out = self.target(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
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


def _append_right_aligned(
    prefix: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor, pad: int
) -> torch.Tensor:
    """Append ``tokens[b, :counts[b]]`` to each row of the right-aligned ``prefix`` (rows stay right-aligned).

    ``lengths`` ``[B]`` are the real lengths after the append; leading columns that are padding in every row are
    dropped, so a single row never carries padding.
    """
    width = tokens.shape[1]
    total = prefix.shape[1] + width
    combined = torch.cat([prefix, tokens], dim=1)  # [B, L + m]; row b's real tokens end at column L + counts[b]
    # Output column j of row b holds combined column j - (m - counts[b]); negative means left padding.
    source = torch.arange(total, device=prefix.device)[None] - (width - counts)[:, None]
    out = combined.gather(1, source.clamp(min=0))
    out = torch.where(source >= 0, out, torch.full_like(out, pad))
    return out[:, total - int(lengths.max()) :]


@torch.no_grad()
def speculative_decode(
    target,
    input_ids: torch.Tensor,
    drafter: Drafter,
    *,
    max_length: int,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    eos_token_id: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    cache: Cache | None = None,
    verify_mode: str | None = None,
    draft_sampling: bool | None = None,
    rollback: str = "per_step",
    streamer=None,
    stats: SpecStats | None = None,
    profile: bool = False,
    on_round: Callable[[Cache, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Generate after ``input_ids`` (``[B, P]``, left-padded) with ``drafter``; returns (sequences, stats).

    ``sequences`` is ``[B, P + longest generation]``: each row's prompt, its generated tokens, then padding, as
    ``target.generate`` returns a batch.

    Args:
        max_length: total length (padded prompt included) at which a row stops, as in ``generate``.
        attention_mask: ``[B, P]`` prompt padding mask (left padding); ``None`` means no padding.
        do_sample: sample the target (``match``/``rejection``) instead of greedy decoding.
        logits_processor: applied identically to target and draft scores (temperature/top-k/top-p included).
        stopping_criteria: checked once per round on every row (EOS and length are enforced per row directly).
        eos_token_id: tokens that end a row; the round's tokens are clipped after the first one.
        pad_token_id: fills finished rows in the output (defaults to the first EOS token, else 0).
        cache: the target cache (a fresh ``DynamicCache`` by default; any cache kind is handled).
        verify_mode: ``"greedy"`` (default without sampling), ``"match"`` or ``"rejection"`` (default with sampling).
        draft_sampling: sample the candidates from the draft distributions (default: only for ``rejection``).
        rollback: linear-attention rollback, ``"per_step"`` (default) or ``"replay"`` (batch size 1).
        streamer: receives the prompt, then every committed chunk, then ``end()`` (batch size 1).
        stats: statistics to append this call's requests (one per row) to.
        profile: synchronise around stages on CUDA so per-stage times are exact.
        on_round: called as ``on_round(cache, prefix)`` after every round's commit (tests inspect the cache).
    """
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    mode = verify_mode or ("rejection" if do_sample else "greedy")
    if mode not in VERIFY_MODES:
        raise ValueError(f"Unknown verification mode {mode!r}; expected one of {VERIFY_MODES}.")
    if mode != "greedy" and not do_sample:
        raise ValueError(f"verify_mode={mode!r} samples the target: pass do_sample=True.")
    if mode == "greedy" and do_sample:
        raise ValueError("verify_mode='greedy' cannot be combined with do_sample=True; use 'match' or 'rejection'.")
    if streamer is not None and batch > 1:
        raise ValueError("Streaming supports batch size 1 only (as in Transformers).")
    draft_sampling = (mode == "rejection") if draft_sampling is None else draft_sampling
    select = TokenSelector(logits_processor, draft_sampling)
    cache = cache if cache is not None else DynamicCache(config=target.config)
    capacity = static_capacity(cache)
    if capacity is not None:
        if batch > 1:
            raise NotImplementedError("Static caches support batch size 1 (ragged rows grow the cache unboundedly).")
        if capacity < max_length + drafter.num_candidates + 1:
            raise ValueError(
                f"The static cache holds {capacity} tokens, too few: speculative decoding up to "
                f"max_length={max_length} with {drafter.num_candidates} candidates needs "
                f"{max_length + drafter.num_candidates + 1} slots."
            )
    stats = stats if stats is not None else SpecStats(drafter.num_candidates, drafter.name)
    requests = [stats.new_request() for _ in range(batch)]
    sync = device if profile else None
    eos = eos_token_id.to(device).flatten() if eos_token_id is not None else None
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None and eos.numel() else 0)
    # EOS and length are enforced per row below; the remaining criteria (stop strings, custom) run per round.
    other_criteria = StoppingCriteriaList(
        [c for c in (stopping_criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    )
    prompt_mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    budget = max_length - prompt_length  # new tokens per row
    runner = _TargetRunner(target, drafter, cache)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    try:
        # ---- Prefill: target over the prompt, first token, drafter state over all prompt positions ----------------
        with stats.stage("prefill", sync):
            positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # per-row positions under left padding
            padded = attention_mask is not None and not bool(prompt_mask.all())
            logits, features, mtp_hidden = runner.forward(
                input_ids, positions, attention_mask if padded else None, logits_to_keep=1
            )
            state = TargetCacheState(target, cache, prompt_mask, rollback=rollback)
            first = select_tokens(process_logits(logits[:, -1], input_ids, logits_processor), do_sample)
        prefix = torch.cat([input_ids, first[:, None]], dim=1)  # committed tokens, right-aligned; last = A
        generated = torch.full((batch, budget + 1), pad, dtype=torch.long, device=device)  # +1: scratch column
        generated[:, 0] = first
        num_generated = torch.ones(batch, dtype=torch.long, device=device)
        # Rows leave the batch when they finish; `rows` maps active rows to the caller's rows.
        rows, rows_host = torch.arange(batch, device=device), list(range(batch))
        all_generated, all_num_generated = generated.clone(), num_generated.clone()
        prompt_lengths = prompt_mask.sum(-1)
        anchor_positions = prompt_lengths.clone()  # position of A per row
        finished = num_generated >= budget
        if eos is not None:
            finished |= torch.isin(first, eos)
        if len(other_criteria):
            finished |= other_criteria(prefix, None)
        if streamer is not None:
            streamer.put(first.cpu())
        if not bool(finished.all()):
            with stats.stage("draft_prefill", sync):
                drafter.reserve(max_length + 1)
                drafter.start(TargetStep(positions, prefix[:, 1:], prompt_mask, mtp_hidden, features))

        while not bool(finished.all()):
            # ---- 1. Draft ---------------------------------------------------------------------------------------
            proposal = drafter.propose(prefix, anchor_positions, select, stats)
            candidates = proposal.tokens  # [B, K]
            num_candidates = candidates.shape[1]
            steps = torch.arange(num_candidates + 1, device=device)

            # ---- 2. Verify: one target forward over [A, T1..TK] per row ---------------------------------------
            with stats.stage("verify", sync):
                verify_ids = torch.cat([prefix[:, -1:], candidates], dim=1)
                verify_positions = anchor_positions[:, None] + steps
                mask = state.attention_mask(num_candidates + 1, target.dtype)
                with state.verifying():
                    logits, features, mtp_hidden = runner.forward(verify_ids, verify_positions, mask)
                target_scores = process_block(logits, prefix, candidates, logits_processor)

                # ---- 3. Accept the longest valid prefix, plus one bonus/correction token per row ---------------
                verdict = verify(mode, candidates, target_scores, proposal.scores)
            accepted = verdict.num_accepted  # [B]
            new_tokens = torch.cat([candidates, candidates[:, :1]], dim=1).scatter(
                1, accepted[:, None], verdict.bonus[:, None]
            )  # [B, K+1]: accepted candidates then the bonus (later columns unused)
            counts = torch.minimum(accepted + 1, budget - num_generated)
            if eos is not None:
                is_eos = torch.isin(new_tokens, eos) & (steps[None] < counts[:, None])
                counts = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, counts)
            counts = torch.where(finished, torch.zeros_like(counts), counts)
            hit_eos = is_eos.any(-1) & ~finished if eos is not None else torch.zeros_like(finished)
            accepted_host, counts_host = accepted.tolist(), counts.tolist()  # host copy for stats and slicing

            # ---- 4. Commit: outputs, then the target cache (A + the kept candidates become history) ------------
            columns = num_generated[:, None] + steps[None]
            columns = torch.where(steps[None] < counts[:, None], columns, torch.full_like(columns, budget))
            generated.scatter_(1, columns, new_tokens)
            num_generated += counts
            prefix = _append_right_aligned(prefix, new_tokens, counts, prompt_lengths + num_generated, pad)
            kept = counts.clamp(min=1)
            with stats.stage("rollback", sync):
                state.commit(
                    kept,
                    num_candidates + 1,
                    replay=lambda n, ids=verify_ids, pos=verify_positions: runner.forward(
                        ids[:, :n], pos[:, :n], logits_to_keep=1, capture=False
                    ),
                )
            for active, row in enumerate(rows_host):
                if counts_host[active]:
                    requests[row].rounds += 1
                    requests[row].hist[accepted_host[active]] += 1
                    requests[row].round_tokens += counts_host[active]
            if streamer is not None and counts_host[0]:
                streamer.put(new_tokens[0, : counts_host[0]].cpu())
            if on_round is not None:
                on_round(cache, prefix)

            finished = finished | hit_eos | (num_generated >= budget)
            if len(other_criteria):
                finished |= other_criteria(prefix, None)

            step = TargetStep(
                verify_positions,
                new_tokens,
                steps[None] < counts[:, None],
                mtp_hidden,
                features,
            )
            if bool(finished.any()) and not bool(finished.all()):
                # Finished rows leave the batch so later rounds do no work for them.
                keep = (~finished).nonzero()[:, 0]
                if drafter.select_rows(keep):
                    gone = finished.nonzero()[:, 0]
                    all_generated[rows[gone]] = generated[gone]
                    all_num_generated[rows[gone]] = num_generated[gone]
                    state.select_rows(keep)
                    keep_host = keep.tolist()
                    rows, rows_host = rows[keep], [rows_host[i] for i in keep_host]
                    counts_host = [counts_host[i] for i in keep_host]
                    generated, num_generated, finished = generated[keep], num_generated[keep], finished[keep]
                    prompt_lengths, anchor_positions = prompt_lengths[keep], anchor_positions[keep]
                    lengths = prompt_lengths + num_generated
                    prefix = prefix[keep][:, prefix.shape[1] - int(lengths.max()) :]
                    step = TargetStep(*(None if t is None else t[keep] for t in step.__dict__.values()))
                    counts = counts[keep]

            # ---- 5. Advance the drafter with the committed positions ------------------------------------------
            if not bool(finished.all()):
                if drafter.fixed_slots:  # all K + 1 slots, the mask says which are real (fixed shapes)
                    drafter.advance(step, stats)
                else:
                    width = max(counts_host)  # already on the host: no extra sync
                    drafter.advance(
                        TargetStep(*(None if t is None else t[:, :width] for t in step.__dict__.values())), stats
                    )
                anchor_positions = anchor_positions + counts
    finally:
        runner.close()
        if streamer is not None:
            streamer.end()
    all_generated[rows] = generated
    all_num_generated[rows] = num_generated
    longest = int(all_num_generated.max())
    return torch.cat([input_ids, all_generated[:, :longest]], dim=1), stats
