"""The speculative decoding loop: prefill, then rounds of draft -> verify -> accept -> commit (docs/design.md §2).

Read top to bottom, :func:`speculative_decode` is one round of DMTP (or of any drafter in ``drafters/``) for a
batch of rows:

1. **Draft.** The drafter proposes K candidates per row after the committed tokens, whose last token A the target
   has not processed yet (DMTP: T1 from the cached MTP hidden -> fusion -> one DFlash forward for T2..T7).
2. **Verify.** One target forward over ``[A, T1..TK]`` at each row's positions ``a .. a+K``, returning logits, the
   DFlash context features and the hidden the MTP head reads.
3. **Accept.** Greedy / match / rejection / block (``accept/verification.py``): ``n`` accepted candidates plus
   one bonus token per row, clipped at EOS, at stopping criteria and at the row's token budget.
4. **Commit** the tokens, then the target cache to ``a + n`` per row (``target/cache.py``: masks for ragged
   attention KV; linear-attention states rebuilt per row).
5. **Advance** the drafter with the committed positions; the MTP head's next output predicts the next T1.

Rows that finish leave the batch (:class:`ActiveBatch`), so later rounds do no work for them. The greedy path
synchronises with the host once per round (the committed counts, which statistics and slicing need).

Options of :func:`speculative_decode`: ``verify_mode`` greedy, match, rejection or block; ``draft_sampling``
(default: on for rejection/block); ``rollback`` rebuild or replay; ``outputs`` keeps scores/logits;
``verify_length`` all K, a number, "auto" or an ``AutoWidth``; ``compile_config`` compiles the verify forward
(static cache, batch size 1).
"""

from __future__ import annotations

import torch
from transformers import CompileConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache

from .accept.batch import Accepted, ActiveBatch, RoundHost, StepOutputs
from .accept.processing import RowProcessors, TokenSelector
from .accept.stopping import RowStopping
from .accept.verification import VERIFY_MODES, process_logits, select_tokens, verify
from .drafters.base import Drafter
from .lookup import LookupRounds
from .stats import RequestStats, SpecStats
from .target.cache import TargetCacheState, new_static_cache, static_capacity
from .target.linear_attention import has_gated_delta_net, verify_kernel_kwargs
from .target.step import DrafterInputs, TargetStep
from .widths import AutoWidth, check_verify_length, width_policy

SAMPLED_DRAFTS = ("rejection", "block")  # verification modes that need the distribution each candidate came from


class TargetRunner:
    """Runs target forwards and returns what drafters need: features at ``target_layer_ids`` and the MTP hidden.

    Only the hidden states the drafter reads are requested (``output_hidden_states`` with layer indices).
    """

    def __init__(self, target, drafter: Drafter, cache: Cache, compile_config=None) -> None:
        self.target = target
        self.cache = cache
        # the verify forward, compiled (Transformers' own `get_compiled_call`, cached on the target) when asked; one
        # graph per verify width (1..K+1), so Dynamo's recompile limit (8) must cover K + 1 of them, plus what plain
        # compiled decoding may already hold on the same compiled call (past it, a width would silently run eager)
        self.verify_call = target.get_compiled_call(compile_config) if compile_config is not None else target
        self.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * (drafter.num_candidates + 2))
        self.drafter_inputs = DrafterInputs(target, drafter)
        self.linear_attention = has_gated_delta_net(target)

    def forward(
        self, input_ids, positions, attention_mask=None, logits_to_keep: int = 0, capture: bool = True, call=None
    ):
        """Target forward over ``input_ids`` ``[B, q]`` at ``positions`` ``[B, q]``: (logits, features, mtp_hidden)."""
        width = input_ids.shape[1]
        kernel_kwargs = verify_kernel_kwargs(self.linear_attention, width)
        out = (call or self.target)(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=(self.drafter_inputs.hidden_indices or None) if capture else None,
            logits_to_keep=logits_to_keep,
            **kernel_kwargs,
        )
        if not capture:
            return out.logits, None, None
        features, mtp_hidden = self.drafter_inputs.read(out)
        return out.logits, features, mtp_hidden

    def verify(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask=None):
        """The round's verify forward (compiled when the call asked for it): (logits, features, mtp_hidden)."""
        if self.verify_call is self.target:
            return self.forward(input_ids, positions, attention_mask)
        with torch._dynamo.config.patch(recompile_limit=self.recompile_limit):
            return self.forward(input_ids, positions, attention_mask, call=self.verify_call)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """A forward that only advances the cache (the ``replay`` rollback re-runs kept tokens with it)."""
        self.forward(input_ids, positions, logits_to_keep=1, capture=False)

    def close(self) -> None:
        """Detach the MTP-hidden hook."""
        self.drafter_inputs.close()


def accept(verdict, candidates: torch.Tensor, scores: torch.Tensor, batch: ActiveBatch, stopping: RowStopping):
    """The tokens of one round per row (an :class:`Accepted`), clipped where plain ``generate`` would stop.

    ``scores`` ``[B, K+1, V]``: the target's processed scores of the round's positions (stopping criteria read them).
    """
    accepted = verdict.num_accepted  # [B]
    bonus = verdict.bonus[:, None]
    new_tokens = torch.cat([candidates, bonus], dim=1).scatter(1, accepted[:, None], bonus)  # [B, k+1], k may be 0
    counts = torch.minimum(accepted + 1, stopping.budget(batch) - batch.num_generated)
    counts = torch.where(batch.finished, torch.zeros_like(counts), counts)
    counts, stop = stopping.clip(batch, new_tokens, counts, scores)
    stop = (stop | (batch.num_generated + counts >= stopping.budget(batch))) & ~batch.finished
    return Accepted(new_tokens, counts, accepted, stop)


def prefill(
    runner: TargetRunner,
    input_ids,
    attention_mask,
    max_length: int,
    stopping: RowStopping,
    logits_processor,
    do_sample: bool,
    rollback: str,
    streamer,
    outputs: StepOutputs | None = None,
):
    """The target over the prompt and the first generated token: ``(batch, drafter start step, target cache
    state)``; rows that end with the first token are marked finished.

    A cache that already holds the first ``c`` prompt tokens (a continued conversation) is continued, as plain
    ``generate`` does: the target runs over the uncached tail only, and the drafter starts from the tail's features
    (the draft never saw the cached turns, which changes only how much it gets accepted)."""
    prompt_mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # per-row positions under left padding
    prompt_lengths = prompt_mask.sum(-1)
    padded = bool((prompt_lengths < input_ids.shape[1]).any())
    cached = cached_prompt_length(runner.cache, input_ids.shape[1])
    tail_ids, tail_positions, tail_mask = input_ids[:, cached:], positions[:, cached:], prompt_mask[:, cached:]
    logits, features, mtp_hidden = runner.forward(
        tail_ids, tail_positions, attention_mask if padded else None, logits_to_keep=1
    )
    scores = process_logits(logits[:, -1], input_ids, logits_processor)  # the prompt is the processors' exact input
    first = select_tokens(scores, do_sample)
    batch = ActiveBatch(first, prompt_lengths, max_length - input_ids.shape[1], stopping.pad, outputs)
    batch.record(torch.zeros_like(first)[:, None], scores[:, None], logits[:, -1:])
    batch.stop(stopping.after_prefill(batch, scores))
    if streamer is not None:
        streamer.put(input_ids.cpu()), streamer.put(first.cpu())
    next_tokens = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)[:, cached:]
    tail_lengths = tail_mask.sum(-1).tolist() if padded else None
    step = TargetStep(tail_positions, next_tokens, tail_mask if padded else None, mtp_hidden, features, tail_lengths)
    return batch, step, TargetCacheState(runner.target, runner.cache, prompt_mask, rollback, runner.replay)


def cached_prompt_length(cache: Cache, prompt_length: int) -> int:
    """How many leading prompt tokens ``cache`` already holds (0 for a new cache). As in plain ``generate``, the
    prompt is the whole conversation so far: the cached tokens, then at least one new one."""
    # A number, not what the cache returns: a static layer's length is its write index itself, a tensor the prefill
    # then advances in place (a slice taken after the prefill would start past the tail).
    cached = int(cache.get_seq_length()) if not all(cache.is_linear) else 0
    if cached >= prompt_length:
        raise ValueError(
            f"The cache passed to generate already holds {cached} positions, but input_ids has {prompt_length} "
            "tokens: pass the whole conversation so far as input_ids (the cached tokens, then the new ones), as plain "
            "generate expects with a cache."
        )
    return cached


def report(requests: list[RequestStats], rows: list[int], host: RoundHost, round_: Accepted, streamer) -> None:
    """Add the round to the statistics of each active row (caller ``rows``; rows that committed nothing are not
    counted) and hand its tokens to the streamer (batch size 1)."""
    if streamer is not None and host.counts[0]:
        streamer.put(round_.new_tokens[0, : host.counts[0]].cpu())
    for row, accepted, count in zip(rows, host.accepted, host.counts, strict=True):
        if count:
            requests[row].add_round(accepted, count)


def check_inputs(
    target, verify_mode, do_sample: bool, input_ids: torch.Tensor, attention_mask, streamer, verify_length=None
) -> str:
    """The verification mode (default: ``rejection`` when sampling, else ``greedy``), after refusing, before any
    forward, what the engine cannot do losslessly: unknown or mismatched verification modes, right-padded batches,
    ragged batches on a flash-attention-2 target, streaming a batch; and a ``verify_length`` it does not know."""
    mode = verify_mode or ("rejection" if do_sample else "greedy")
    check_verify_length(verify_length)
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("Streaming supports batch size 1 only (as in Transformers).")
    empty = [] if attention_mask is None else (~attention_mask.bool().any(-1)).nonzero()[:, 0].tolist()
    if empty:
        raise ValueError(
            f"Row(s) {empty} of attention_mask are all zeros: an empty prompt has no last token to continue from "
            "(plain generate attends to padding there). Drop those rows or give each at least one token."
        )
    if attention_mask is not None and not bool(attention_mask[:, -1].all()):
        raise ValueError(
            "The batch is right-padded (attention_mask ends with 0 in some row): speculative decoding continues "
            "every row from its last token, so pad on the left (tokenizer.padding_side = 'left')."
        )
    implementation = getattr(target.config, "_attn_implementation", None) or ""
    if "flash" in implementation and input_ids.shape[0] > 1:
        raise NotImplementedError(
            f"{type(target).__name__} runs attn_implementation={implementation!r}, which cannot take the per-row "
            "attention masks of a batch whose rows accept different numbers of tokens. Load the target with "
            "attn_implementation='sdpa' for batches, or decode one unpadded row at a time."
        )
    if mode not in VERIFY_MODES:
        raise ValueError(f"Unknown verification mode {mode!r}; expected one of {VERIFY_MODES}.")
    if mode != "greedy" and not do_sample:
        raise ValueError(f"verify_mode={mode!r} samples the target: pass do_sample=True.")
    if mode == "greedy" and do_sample:
        raise ValueError("verify_mode='greedy' cannot be combined with do_sample=True; use 'match' or 'rejection'.")
    return mode


def target_cache(
    target, cache: Cache | None, batch_size: int, max_length: int, num_candidates: int, compile_config=None
) -> Cache:
    """The target's cache for the call, by one rule for every entry point.

    None given: a ``DynamicCache``, or a ``StaticCache`` when the verify is compiled (its shapes must not grow).
    A static cache needs room for one verify past ``max_length`` (``max_length + K + 1`` slots; Transformers sizes
    the one it makes for ``max_length - 1``), and a compiled verify needs a static cache: an empty cache that
    misses either is replaced by one that fits; one that already holds a conversation cannot be, and is refused.
    Static caches serve batch size 1 (ragged rows would grow them without bound).
    """
    needed = max_length + num_candidates + 1
    if cache is None:
        return new_static_cache(target, needed) if compile_config is not None else DynamicCache(config=target.config)
    capacity = static_capacity(cache)
    too_small = capacity is not None and capacity < needed
    grows = compile_config is not None and capacity is None
    if too_small or grows:
        if cache.get_seq_length() > 0:
            raise ValueError(
                f"The static cache passed to generate holds a conversation in {capacity} slots, too few for "
                f"speculative decoding up to max_length={max_length} ({needed} slots: a verify writes "
                f"{num_candidates + 1} past the committed tokens). Start the conversation with a larger StaticCache, "
                "or a DynamicCache."
                if too_small
                else "A compiled verify needs a static cache, but the cache passed to generate is a growing one "
                "holding a conversation: continue it without dmtp_compile, or start it with a StaticCache."
            )
        cache = new_static_cache(target, needed)
        capacity = static_capacity(cache)
    if capacity is not None and batch_size > 1:
        raise NotImplementedError(
            "Static caches (and so a compiled verify) support batch size 1 (ragged rows grow the cache unboundedly)."
        )
    return cache


def start_drafter(drafter: Drafter, step: TargetStep, max_length: int, stats: SpecStats, verify_length, target) -> None:
    """The drafter over the prompt, with its capacity for the call and its round width policy (``verify_length``),
    which hears every stage's time from the statistics' timer."""
    policy = width_policy(verify_length, target, drafter, step.positions.shape[0])  # "auto": times the target
    with stats.stage("draft_prefill"):
        drafter.width_policy = policy
        drafter.reserve(max_length + 1)
        drafter.start(step)
    stats.listener = policy.timed


def prompt_lookup_rounds(
    prompt_lookup: bool | None, drafter: Drafter, target, input_ids: torch.Tensor, attention_mask, sampled: bool
) -> LookupRounds | None:
    """Prompt lookup competing with the draft (``None``: on under ``verify_length="auto"``); it needs the policy
    that prices both, so asking for it with a fixed width is refused. ``sampled``: the verification compares
    distributions (a copied token's is one-hot over the target's vocabulary)."""
    policy = getattr(drafter, "width_policy", None)
    if not isinstance(policy, AutoWidth):
        if prompt_lookup:
            raise ValueError(
                "prompt_lookup=True needs verify_length='auto' (the policy that weighs it against the draft)"
            )
        return None
    if prompt_lookup is False:
        return None
    vocab = target.get_output_embeddings().weight.shape[0] if sampled else None
    return LookupRounds(input_ids, attention_mask, policy, vocab)


def close(runner: TargetRunner, state: TargetCacheState | None, streamer, drafter: Drafter, stats: SpecStats) -> None:
    """Detach every hook from the target and end the stream, whatever happened; count graphed stages and widths."""
    stats.record_graphs(drafter.graph_calls())
    stats.record_widths(getattr(drafter, "width_policy", None))
    stats.listener = None
    runner.close()
    if state is not None:
        state.close()
    if streamer is not None:
        streamer.end()


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
    rollback: str = "rebuild",
    streamer=None,
    stats: SpecStats | None = None,
    profile: bool = False,
    outputs: StepOutputs | None = None,
    verify_length: int | str | None = None,
    compile_config: CompileConfig | None = None,
    prompt_lookup: bool | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Generate after ``input_ids`` ``[B, P]`` (left-padded) with ``drafter``: ``(sequences, stats)`` as ``generate``
    returns them (the options: this module's docstring)."""
    mode = check_inputs(target, verify_mode, do_sample, input_ids, attention_mask, streamer, verify_length)
    cache = target_cache(target, cache, input_ids.shape[0], max_length, drafter.num_candidates, compile_config)
    stats = stats if stats is not None else SpecStats(drafter.num_candidates, drafter.name)
    stats.sync_device = input_ids.device if profile else None
    requests = [stats.new_request() for _ in input_ids]
    select = TokenSelector(logits_processor, mode in SAMPLED_DRAFTS if draft_sampling is None else draft_sampling)
    processors = RowProcessors(logits_processor, input_ids)  # each row's inputs exactly as plain generate's
    stopping = RowStopping(input_ids, stopping_criteria, eos_token_id, pad_token_id)
    runner = TargetRunner(target, drafter, cache, compile_config)
    state = None
    lookups = None
    try:
        with stats.stage("prefill"):
            batch, step, state = prefill(
                runner,
                input_ids,
                attention_mask,
                max_length,
                stopping,
                logits_processor,
                do_sample,
                rollback,
                streamer,
                outputs,
            )
        select.for_batch(processors, batch)
        if not batch.done:
            start_drafter(drafter, step, max_length, stats, verify_length, target)
            sampled = mode in SAMPLED_DRAFTS  # the verify compares distributions: a copied token's is one-hot
            lookups = prompt_lookup_rounds(prompt_lookup, drafter, target, input_ids, attention_mask, sampled)
        with stats.stage("rounds"):  # every stage below runs inside; the stage times add up to this one
            while not batch.done:
                # 1. Draft: up to K candidates per row after A, the last committed token (or prompt lookup's).
                proposal = drafter.propose(batch.last_tokens, batch.anchor_positions, select, stats)
                if lookups is not None:
                    proposal = lookups.merge(proposal, batch, drafter.num_candidates)
                candidates = proposal.tokens  # [B, k]
                # 2. Verify: one target forward over [A, T1..Tk] at each row's positions a .. a+k.
                with stats.stage("verify"):
                    verify_ids, verify_positions = batch.verify_inputs(candidates)
                    with state.verifying(verify_ids, verify_positions):
                        mask = state.attention_mask(verify_ids.shape[1], target.dtype)
                        logits, features, mtp_hidden = runner.verify(verify_ids, verify_positions, mask)
                    scores = processors.block(logits, batch, candidates)
                    # 3. Accept the longest valid prefix, plus one bonus/correction token per row.
                    verdict = verify(mode, candidates, scores, proposal.scores, select.do_sample)
                    round_ = accept(verdict, candidates, scores, batch, stopping)
                # 4. Commit the tokens, then the target cache: A and the kept candidates become history.
                with stats.stage("commit"):
                    rows = batch.host.rows
                    host = batch.commit(round_, scores, logits)
                    report(requests, rows, host, round_, streamer)
                with stats.stage("rollback"):
                    state.commit(round_.counts.clamp(min=1), [max(c, 1) for c in host.counts])
                step = round_.committed(verify_positions, mtp_hidden, features, host.counts)
                if any(batch.host.finished) and not batch.done:
                    step = leave(batch, drafter, state, step, lookups)
                # 5. Advance the drafter with the committed positions; the MTP head's next g predicts the next T1.
                if not batch.done:
                    if lookups is not None:
                        lookups.learn(step.num_valid)
                    drafter.advance(step, stats)
    finally:
        close(runner, state, streamer, drafter, stats)
    return batch.sequences(input_ids, stopping.budget(batch)), stats


def leave(
    batch: ActiveBatch, drafter: Drafter, state: TargetCacheState, step: TargetStep, lookups: LookupRounds | None
) -> TargetStep:
    """Finished rows leave the batch (when the drafter can drop rows), so later rounds do no work for them."""
    keep_host = [i for i, done in enumerate(batch.host.finished) if not done]
    keep = torch.tensor(keep_host, device=batch.rows.device)
    if not drafter.select_rows(keep, keep_host):
        return step
    if lookups is not None:
        lookups.select_rows(keep)
    batch.keep(keep, keep_host)
    state.select_rows(keep)
    return step.select_rows(keep, keep_host)
