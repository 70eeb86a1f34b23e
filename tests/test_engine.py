"""The speculative decoding engine: lossless greedy output for every family/strategy/layout, rollback of every
cache kind, sampling preserves the target distribution, statistics definitions, generate() integration."""

import random

import pytest
import torch
from conftest import draft_for
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from dmtp_hf.assistant import SpecStats, speculative_decode
from dmtp_hf.assistant.drafters.base import Drafter, DrafterWrapper, Proposal
from dmtp_hf.assistant.drafters.dflash import DFlashDrafter
from dmtp_hf.assistant.drafters.dmtp import DMTPDrafter
from dmtp_hf.assistant.drafters.mtp import MTPDrafter
from dmtp_hf.assistant.generate import generate as dmtp_generate
from dmtp_hf.assistant.widths import FixedWidth
from dmtp_hf_assets.tiny_targets import FAMILIES, load_tiny_target, make_tiny_target

MAX_NEW = 24


class OracleMix(DrafterWrapper):
    """Wraps a real drafter and overwrites a random-length prefix of its candidates with the target's true greedy
    continuation, so rounds accept every possible number of candidates and the inner drafter's state advancement
    (MTP cache, DFlash context) is exercised after partial acceptance."""

    def __init__(self, inner: Drafter, reference: torch.Tensor, seed: int = 0):
        super().__init__(inner)
        self.reference, self.rng = reference, random.Random(seed)

    def propose(self, anchor_ids, anchor_positions, select, stats):
        proposal = self.inner.propose(anchor_ids, anchor_positions, select, stats)
        tokens = proposal.tokens.clone()
        length = int(anchor_positions[0]) + 1  # committed tokens (one unpadded row)
        truth = self.reference[:, length : length + self.rng.randint(0, proposal.tokens.shape[1])]
        tokens[:, : truth.shape[1]] = truth
        return Proposal(tokens, proposal.scores)


def strategies(target):
    dual = draft_for(target)
    dflash = draft_for(target, anchor_layout="dflash")
    return {
        "dmtp": DMTPDrafter(dual, dual.native_mtp),
        "dflash": DFlashDrafter(dflash),
        "mtp1": MTPDrafter(dual.native_mtp, 1),
        "mtp4": MTPDrafter(dual.native_mtp, 4),
    }


def greedy_reference(target, prompt, max_new_tokens=MAX_NEW, **kwargs):
    return target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Lossless greedy decoding


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_to_generate_for_every_strategy(targets, family):
    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = greedy_reference(target, prompt)
    for name, drafter in strategies(target).items():
        for oracle in (False, True):
            used = OracleMix(drafter, reference, seed=3) if oracle else drafter
            stats = SpecStats(used.num_candidates, name)
            out, stats = speculative_decode(target, prompt, used, max_length=reference.shape[1], stats=stats)
            assert torch.equal(out, reference), f"{family}/{name} oracle={oracle}"
            if oracle:  # several different acceptance lengths were exercised
                assert sum(1 for count in stats.hist if count) >= 2, stats.hist


class FewerCandidates(DrafterWrapper):
    """Asks the inner drafter for a different number of candidates (1..K) every round, through its width policy."""

    def __init__(self, inner, seed=0):
        super().__init__(inner)
        self.rng, self.widths = random.Random(seed), []

    def propose(self, anchor_ids, anchor_positions, select, stats):
        width = self.rng.randint(1, self.num_candidates)
        self.inner.width_policy = FixedWidth(width, self.num_candidates, self.stage_plan())
        proposal = self.inner.propose(anchor_ids, anchor_positions, select, stats)
        assert proposal.tokens.shape[1] == width and (proposal.scores is None or proposal.scores.shape[1] == width)
        self.widths.append(width)
        return proposal


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_drafters_may_propose_fewer_candidates_and_stay_lossless(targets, family):
    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3]])
    reference = greedy_reference(target, prompt)
    for name, drafter in strategies(target).items():
        for fast in (False, True):
            drafter.fixed_shapes = fast
            fewer = FewerCandidates(OracleMix(drafter, reference, seed=3), seed=5)
            out, stats = speculative_decode(target, prompt, fewer, max_length=reference.shape[1])
            assert torch.equal(out, reference), (name, fast)
            assert len(set(fewer.widths)) > 1 or drafter.num_candidates == 1


@pytest.mark.parametrize(
    "layout,fusion",
    [
        ("single", "none"),
        ("single", "hidden_residual"),
        ("single", "replace"),
        ("single", "residual"),
        ("dual", "replace"),
        ("dual", "none"),
    ],
)
def test_greedy_identical_for_every_layout_and_fusion(targets, layout, fusion):
    target = targets["qwen3_5"]
    prompt = torch.tensor([[11, 12, 13, 90, 91]])
    reference = greedy_reference(target, prompt)
    draft = draft_for(target, anchor_layout=layout, fusion=fusion)
    drafter = OracleMix(DMTPDrafter(draft, draft.native_mtp), reference, seed=5)
    out, _ = speculative_decode(target, prompt, drafter, max_length=reference.shape[1])
    assert torch.equal(out, reference)


def test_generate_entry_points_and_edge_cases(targets):
    target = targets["qwen3_5_moe"]
    draft = draft_for(target)
    prompt = torch.tensor([[7, 8, 9, 10]])
    reference = greedy_reference(target, prompt, max_new_tokens=30)

    # through target.generate(assistant_model=...) on a stateful (hybrid) target, with the dict output
    out = target.generate(
        prompt, assistant_model=draft, do_sample=False, max_new_tokens=30, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, reference)
    assert out.spec_stats.num_rounds > 0 and out.spec_stats.strategy == "dmtp"

    # max_new_tokens in mid-block, for every budget
    for budget in (1, 2, 5, 9):
        got = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=budget)
        assert torch.equal(got, reference[:, : prompt.shape[1] + budget])

    # EOS in mid-block: stop exactly where plain generate stops
    eos = int(reference[0, prompt.shape[1] + 6])
    expected = greedy_reference(target, prompt, max_new_tokens=30, eos_token_id=eos)
    got = dmtp_generate(
        target,
        prompt,
        OracleMix(DMTPDrafter(draft, draft.native_mtp), reference),
        do_sample=False,
        max_new_tokens=30,
        eos_token_id=eos,
    )
    assert torch.equal(got, expected)

    # prompt of length 1
    one = torch.tensor([[42]])
    assert torch.equal(
        target.generate(one, assistant_model=draft, do_sample=False, max_new_tokens=12),
        greedy_reference(target, one, max_new_tokens=12),
    )

    # a draft that is always wrong still decodes losslessly (one token per round)
    class AlwaysWrong(DMTPDrafter):
        def propose(self, anchor_ids, anchor_positions, select, stats):
            proposal = super().propose(anchor_ids, anchor_positions, select, stats)
            truth = reference[:, int(anchor_positions[0]) + 1]
            return Proposal(torch.where(proposal.tokens == truth, (truth + 1) % 100, proposal.tokens), None)

    wrong = AlwaysWrong(draft, draft.native_mtp)
    got, stats = speculative_decode(target, prompt, wrong, max_length=reference.shape[1])
    assert torch.equal(got, reference)
    assert stats.hist[0] == stats.num_rounds and stats.acceptance_length_per_verify == 1.0

    # logits processors apply identically to draft and target
    kwargs = dict(do_sample=False, max_new_tokens=20, repetition_penalty=1.3, no_repeat_ngram_size=3)
    assert torch.equal(target.generate(prompt, assistant_model=draft, **kwargs), target.generate(prompt, **kwargs))

    # a plain generate on the bound target is untouched
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30), reference)


def test_streamer_receives_exactly_the_output(targets):
    target = targets["deepseek_v3"]
    draft = draft_for(target)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])

    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=15, streamer=streamer)
    assert streamer.ended and torch.equal(torch.cat(streamer.chunks), out[0])


# ---------------------------------------------------------------------------------------------------------------
# Rollback: after every round the target cache equals a fresh prefill over the committed tokens


def _cache_tensors(cache):
    out = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            out += [s for s in layer.recurrent_states.values() if s is not None]
            out += [s[..., -layer.conv_kernel_size[i] :] for i, s in layer.conv_states.items() if s is not None]
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "deepseek_v3"])
def test_cache_after_every_round_equals_fresh_prefill(targets, family):
    target = targets[family]
    prompt = torch.tensor([[21, 22, 23, 24, 25, 26]])
    reference = greedy_reference(target, prompt)
    cache = DynamicCache(config=target.config)
    checked = []

    def check(sequence):
        fresh = DynamicCache(config=target.config)
        with torch.no_grad():
            target(sequence[:, :-1], cache=fresh, use_cache=True)
        ours, theirs = _cache_tensors(cache), _cache_tensors(fresh)
        assert len(ours) == len(theirs) and len(ours) > 0
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        checked.append(sequence.shape[1])

    class Checked(OracleMix):  # after every commit and rollback, before the drafter advances
        def propose(self, anchor_ids, anchor_positions, select, stats):
            self.select = select
            return super().propose(anchor_ids, anchor_positions, select, stats)

        def advance(self, step, stats=None):
            check(self.select.committed_ids()[0])
            super().advance(step, stats)

    drafter = Checked(strategies(target)["dmtp"], reference, seed=11)
    out, _ = speculative_decode(target, prompt, drafter, max_length=reference.shape[1], cache=cache)
    check(out)  # and after the last round
    assert len(checked) >= 3
    if family.startswith("qwen"):
        assert any(
            isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=target.config).layers
        )


# ---------------------------------------------------------------------------------------------------------------
# Sampling: the output distribution is the target's


@pytest.fixture(scope="module")
def tiny_vocab_target(tmp_path_factory):
    """A DeepSeek-V3 tiny target (with its MTP head) over a 6-token vocabulary, for exact distributions."""
    target = load_tiny_target(make_tiny_target("deepseek_v3", tmp_path_factory.mktemp("v6"), vocab_size=6))
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # peaked but not degenerate: drafts are accepted and rejected
    return target


def _tiny_vocab_drafter(target, strategy):
    common = dict(num_candidates=3, num_hidden_layers=1, target_layer_ids=[0])
    if strategy == "dflash":
        return DFlashDrafter(draft_for(target, anchor_layout="dflash", fusion="none", **common))
    draft = draft_for(target, **common)
    if strategy == "dmtp":
        return DMTPDrafter(draft, draft.native_mtp)
    return MTPDrafter(draft.native_mtp, 2)


def _exact_distribution(target, prompt, steps, temperature):
    """P(x_{P+1..P+steps}) by enumeration: the target's exact distribution of the first `steps` tokens."""
    vocab = target.config.vocab_size
    probs = {(): 1.0}
    for _ in range(steps):
        new = {}
        for seq, p in probs.items():
            ids = torch.cat([prompt, torch.tensor([list(seq)], dtype=torch.long)], dim=1)
            with torch.no_grad():
                dist = (target(ids).logits[0, -1].float() / temperature).softmax(-1)
            for tok in range(vocab):
                new[seq + (tok,)] = p * float(dist[tok])
        probs = new
    return probs


@pytest.mark.parametrize(
    "strategy,mode", [("dflash", "match"), ("dflash", "rejection"), ("dmtp", "rejection"), ("mtp", "rejection")]
)
def test_sampling_preserves_target_distribution(tiny_vocab_target, strategy, mode):
    """Chi-square goodness of fit of the first 3 sampled tokens against the exact target distribution, at a 0.1%
    significance level (a biased verifier fails it by many orders of magnitude)."""
    from scipy.stats import chisquare  # noqa: PLC0415

    target = tiny_vocab_target
    prompt = torch.tensor([[1, 2, 0]])
    steps, temperature, runs = 3, 1.5, 600
    exact = _exact_distribution(target, prompt, steps, temperature)
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    counts = {}
    drafter = _tiny_vocab_drafter(target, strategy)
    stats = SpecStats(drafter.num_candidates)
    torch.manual_seed(1234)
    for _ in range(runs):
        out, _ = speculative_decode(
            target,
            prompt,
            drafter,
            max_length=prompt.shape[1] + steps,
            do_sample=True,
            logits_processor=processors,
            verify_mode=mode,
            stats=stats,
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
    # Merge rare cells so every expected count is >= 5 (chi-square validity), then test at alpha = 0.001.
    cells = sorted(exact, key=exact.get, reverse=True)
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for cell in cells:
        e = exact[cell] * runs
        if e >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += e
    observed.append(rest_o)
    expected.append(rest_e)
    assert stats.num_rounds > 0 and 0 < stats.first_candidate_acceptance  # drafts were really accepted sometimes
    total = sum(expected)
    expected = [e * runs / total for e in expected]  # remove float round-off so the sums agree exactly
    p_value = chisquare(observed, expected).pvalue
    assert p_value > 1e-3, (strategy, mode, p_value, observed, expected)


def test_sampling_through_generate_runs(targets):
    target = targets["qwen3_5"]
    draft = draft_for(target)
    prompt = torch.tensor([[4, 5, 6]])
    torch.manual_seed(0)
    out = target.generate(
        prompt, assistant_model=draft, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=10
    )
    assert out.shape == (1, 13)


# ---------------------------------------------------------------------------------------------------------------
# Statistics definitions


def test_statistics_follow_the_design_definitions():
    stats = SpecStats(num_candidates=3)
    a, b = stats.new_request(), stats.new_request()
    a.hist, a.rounds, a.round_tokens = [1, 0, 2, 1], 4, 1 + 3 + 3 + 4
    b.hist, b.rounds, b.round_tokens = [2, 1, 0, 0], 3, 1 + 1 + 2
    assert stats.hist == [3, 1, 2, 1]
    assert stats.acceptance_length_per_verify == pytest.approx(1 + (0 * 3 + 1 * 1 + 2 * 2 + 3 * 1) / 7)
    assert stats.acceptance_length_per_request == pytest.approx((11 / 4 + 4 / 3) / 2)
    assert stats.first_candidate_acceptance == pytest.approx(1 - 3 / 7)
    assert stats.cumulative_acceptance == pytest.approx([4 / 7, 3 / 7, 1 / 7])
    assert stats.conditional_acceptance == pytest.approx([4 / 7, 3 / 4, 1 / 3])
    assert stats.to_dict()["hist"] == [3, 1, 2, 1]


# ---------------------------------------------------------------------------------------------------------------
# The same drafters inside Transformers' stock assisted-decoding loop (non-stateful targets)


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_candidate_generator_in_transformers_loop_is_lossless(targets, family):
    from dmtp_hf.assistant.candidate_generator import generate_with_transformers_loop

    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = greedy_reference(target, prompt)
    for name, drafter in strategies(target).items():
        mixed, stats = OracleMix(drafter, reference, seed=2), SpecStats(drafter.num_candidates, name)
        out = generate_with_transformers_loop(
            target, prompt, mixed, stats=stats, do_sample=False, max_new_tokens=MAX_NEW
        )
        assert torch.equal(out, reference), name
        assert sum(1 for count in stats.hist if count) >= 2


def test_transformers_loop_refuses_stateful_targets(targets):
    from dmtp_hf.assistant.candidate_generator import generate_with_transformers_loop

    target = targets["qwen3_5"]
    with pytest.raises(ValueError, match="stateful"):
        generate_with_transformers_loop(target, torch.tensor([[1, 2]]), strategies(target)["dmtp"], max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------------------
# Static caches: in-place rollback (no reallocation), identical outputs


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_static_cache_path_matches_dynamic_path(targets, family):
    from transformers import StaticCache

    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = greedy_reference(target, prompt)
    drafter = strategies(target)["dmtp"]
    dynamic, _ = speculative_decode(
        target, prompt, OracleMix(drafter, reference, seed=4), max_length=reference.shape[1]
    )
    cache = StaticCache(config=target.config, max_cache_len=reference.shape[1] + 8)
    static, stats = speculative_decode(
        target, prompt, OracleMix(drafter, reference, seed=4), max_length=reference.shape[1], cache=cache
    )
    assert torch.equal(static, dynamic) and torch.equal(static, reference)
    assert sum(1 for count in stats.hist if count) >= 2
    # through generate(cache_implementation="static"): the cache is resized for the verify's extra slots
    out = target.generate(
        prompt,
        assistant_model=draft_for(target),
        do_sample=False,
        max_new_tokens=MAX_NEW,
        cache_implementation="static",
    )
    assert torch.equal(out, reference)
    # an empty static cache too small for a verify past max_length is replaced; one holding a conversation is refused
    out, _ = speculative_decode(
        target, prompt, drafter, max_length=40, cache=StaticCache(config=target.config, max_cache_len=20)
    )
    assert torch.equal(out, greedy_reference(target, prompt, max_new_tokens=40 - prompt.shape[1]))
    held = StaticCache(config=target.config, max_cache_len=20)
    target(input_ids=prompt, cache=held, use_cache=True)
    with pytest.raises(ValueError, match="holds a conversation in 20 slots"):
        speculative_decode(target, torch.cat([prompt, prompt], dim=1), drafter, max_length=40, cache=held)


def test_sliding_window_target_rolls_back():
    """A sliding-window target (window smaller than the output) keeps exactly its window after partial accepts."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=0,
        layer_types=["sliding_attention"] * 2,
    )
    target = Qwen2ForCausalLM(config).eval()
    draft = draft_for(target, anchor_layout="dflash", target_layer_ids=[0])
    prompt = torch.arange(1, 11)[None]
    reference = greedy_reference(target, prompt, max_new_tokens=30)
    out, stats = speculative_decode(
        target, prompt, OracleMix(DFlashDrafter(draft), reference, seed=3), max_length=reference.shape[1]
    )
    assert torch.equal(out, reference)
    assert sum(1 for count in stats.hist if count) >= 3


def test_round_stage_times_add_up_to_the_rounds(targets):
    from dmtp_hf.assistant.stats import ROUND_STAGES

    target = targets["qwen3_5"]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    for drafter in strategies(target).values():
        _, stats = speculative_decode(target, prompt, drafter, max_length=prompt.shape[1] + 40, profile=True)
        inside = sum(stats.stage_seconds.get(name, 0.0) for name in ROUND_STAGES)
        rounds = stats.stage_seconds["rounds"]
        assert 0.85 * rounds <= inside <= rounds, (drafter.name, dict(stats.stage_seconds))


def test_rollback_rebuilds_with_the_kernels_transformers_resolved_for_the_layer(targets, monkeypatch):
    """The rebuild calls the gated-delta-rule functions of the layer's own module, which Transformers resolves once
    (flash-linear-attention when installed, else the torch reference) for the verify and the rebuild alike."""
    import sys

    target = targets["qwen3_5"]
    layer = next(m for m in target.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    module = sys.modules[type(layer).__module__]
    calls = {"recurrent": 0, "chunk": 0}
    for kind, name in (("recurrent", "torch_recurrent_gated_delta_rule"), ("chunk", "torch_chunk_gated_delta_rule")):
        resolved = getattr(module, name)

        def spy(*args, _resolved=resolved, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _resolved(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3]])
    reference = greedy_reference(target, prompt)
    before = dict(calls)
    out, stats = speculative_decode(
        target, prompt, OracleMix(strategies(target)["dmtp"], reference, seed=2), max_length=reference.shape[1]
    )
    assert torch.equal(out, reference)
    partial = sum(stats.hist[:-1])  # rounds that rejected some candidate: each rebuilds every layer's state
    assert partial > 0 and calls["recurrent"] - before["recurrent"] >= partial  # the rebuilds (verifies are chunked)
    assert calls["chunk"] > before["chunk"]  # the verifies themselves


def test_a_greedy_round_synchronises_with_the_host_once(targets, monkeypatch):
    """Counting every device->host read (`tolist`, `item`, `bool`, `int`, `float` of a tensor) between two
    proposals: one per round (the committed counts), with or without logits processors, at batch size 1 and 2;
    a custom stopping criterion adds the two documented in `RowStopping` (its inputs need the counts on the host,
    and its verdicts are read back)."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, StoppingCriteria

    target = targets["qwen3_5"]  # hybrid: the GatedDeltaNet rollback runs too
    count = [0]
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    class Marks(DrafterWrapper):
        def __init__(self, inner):
            super().__init__(inner)
            self.marks = []

        def propose(self, *args, **kwargs):
            self.marks.append(count[0])
            return super().propose(*args, **kwargs)

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor([[5, 17, 42, 9, 77, 3], [0, 0, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])
    for rows in (1, 2):
        for name, drafter in [(n, d) for n, d in strategies(target).items() if n in ("dmtp", "mtp4")]:
            for options, allowed in (
                ({}, 1),
                ({"logits_processor": processors}, 1),
                ({"stopping_criteria": [Never()]}, 3),
            ):
                marks = Marks(drafter)
                speculative_decode(
                    target,
                    ids[:rows],
                    marks,
                    max_length=ids.shape[1] + 16,
                    attention_mask=mask[:rows],
                    pad_token_id=0,
                    **options,
                )
                per_round = [b - a for a, b in zip(marks.marks, marks.marks[1:])]
                assert per_round and max(per_round) <= allowed, (name, rows, options, per_round)


def test_the_engines_per_round_bookkeeping_does_not_grow_with_length(targets):
    """O(L) copying in total: tokens, cache validity and drafter state are written in place, so the engine's own
    per-round work (commit + rollback stages) at the end of a 384-token generation is what it was at the start.
    Work is counted, not timed: the elements every tensor op of those stages writes (a dispatch mode sees each op;
    views write nothing)."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class ElementsWritten(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:
                return out
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for tensor in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                if any(tensor is i for i in inputs):  # in place: it wrote at most what it was given
                    self.count += max((i.numel() for i in inputs if i is not tensor), default=0)
                else:
                    self.count += tensor.numel()
            return out

    class PerRound(SpecStats):
        def __init__(self, *args):
            super().__init__(*args)
            self.rounds_elements = []

        @contextlib.contextmanager
        def stage(self, name, sync_device=None):
            if name not in ("commit", "rollback"):
                with super().stage(name, sync_device):
                    yield
                return
            with super().stage(name, sync_device), ElementsWritten() as counter:
                yield
            self.rounds_elements.append(counter.count)

    target = targets["deepseek_v3"]
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = greedy_reference(target, prompt, max_new_tokens=384, eos_token_id=None)
    drafter = strategies(target)["dflash"]
    stats = PerRound(drafter.num_candidates, "dflash")
    out, _ = speculative_decode(
        target, prompt, OracleMix(drafter, reference, seed=3), max_length=reference.shape[1], stats=stats
    )
    assert torch.equal(out, reference)
    per_round = [a + b for a, b in zip(stats.rounds_elements[::2], stats.rounds_elements[1::2])]  # commit + rollback
    assert len(per_round) > 50 and min(per_round) > 0
    # medians: the rare round that doubles a buffer (amortised O(1)) copies what it holds
    first, last = sorted(per_round[5:25])[10], sorted(per_round[-20:])[10]
    assert last <= 1.1 * first, (first, last)
