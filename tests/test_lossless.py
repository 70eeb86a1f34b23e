"""Lossless everywhere: every generate option and processor keeps its meaning at every batch size.

- The five reported cases, as regressions (the bundled target and its DMTP draft, real text).
- Differential fuzzing: random generation configs, speculative output vs plain ``target.generate`` token for token
  (``DMTP_FUZZ_CASES`` sets the number of cases, 200 by default; ``-m slow`` runs 2,000).
- Distributions: chi-square tests of sampled output against the exact target distribution on a 6-token vocabulary
  (top-k/top-p/min-p, batches, greedy drafts under rejection, the fast path, Transformers' own assisted loop).
- Bad inputs fail early with an error that says what to do.
"""

import os
import random

import pytest
import torch
from conftest import draft_for
from test_batching import BatchOracle
from test_engine import _tiny_vocab_drafter
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import dmtp_hf
from dmtp_hf.assistant import DFlashDrafter, DMTPDrafter, MTPDrafter, speculative_decode, verify
from dmtp_hf.assistant.candidate_generator import generate_with_transformers_loop
from dmtp_hf.bundled import default_paths
from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target

# ---------------------------------------------------------------------------------------------------------------
# The reported cases, on the bundled models


@pytest.fixture(scope="module")
def bundled():
    paths = default_paths(("target", "dmtp"))
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    draft = dmtp_hf.DMTPDraftModel.from_pretrained(paths["dmtp"], target=target).eval()
    chats = [
        "hello, how are you?",
        "Write the Python function `quote` of the `shlex` module.",
        "what food do you like?",
    ]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in chats
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return target, draft, tokenizer, batch


def both(target, draft, **kwargs):
    plain = target.generate(do_sample=False, **kwargs)
    return plain, target.generate(assistant_model=draft, do_sample=False, **kwargs)


def test_stop_strings_with_tokenizer_stop_where_generate_stops(bundled):
    target, draft, tokenizer, batch = bundled
    for rows in (1, 3):
        inputs = {k: v[:rows] for k, v in batch.items()}
        plain, ours = both(target, draft, **inputs, stop_strings=["the", "def"], tokenizer=tokenizer, max_new_tokens=60)
        assert torch.equal(plain, ours)
        assert plain.shape[1] < inputs["input_ids"].shape[1] + 60  # a stop string really ended the generation


def test_min_new_tokens_in_a_left_padded_batch(bundled):
    target, draft, _, batch = bundled
    plain, ours = both(target, draft, **batch, min_new_tokens=30, max_new_tokens=40)
    assert torch.equal(plain, ours)


def test_repetition_penalty_when_rows_leave_the_batch(bundled):
    target, draft, _, batch = bundled
    plain, ours = both(target, draft, **batch, repetition_penalty=1.3, max_new_tokens=40)
    assert torch.equal(plain, ours)


def test_custom_criteria_see_every_token_and_the_scores(bundled):
    target, draft, _, batch = bundled
    seen_scores = []

    class StopAfterToken(StoppingCriteria):
        """Stops a row right after it emits a given token; records whether scores were passed."""

        def __call__(self, input_ids, scores, **kwargs):
            seen_scores.append(scores is not None)
            return input_ids[:, -1] == 271  # a frequent token of the bundled target's answers

    criteria = StoppingCriteriaList([StopAfterToken()])
    plain = target.generate(**batch, stopping_criteria=criteria, max_new_tokens=60, do_sample=False)
    seen_scores.clear()
    ours = target.generate(**batch, assistant_model=draft, stopping_criteria=criteria, max_new_tokens=60)
    assert torch.equal(plain, ours) and seen_scores and all(seen_scores)  # plain generate passes None by default
    assert (plain[:, batch["input_ids"].shape[1] :] == 271).any()


def test_rejection_never_accepts_a_token_the_target_forbids(monkeypatch):
    # p = 0 for the candidate (top-k/top-p cut it), q = 1 (a greedy draft), and u = 0: `u * q <= p` accepted it.
    monkeypatch.setattr(torch, "rand_like", torch.zeros_like)
    target_scores = torch.tensor([[[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]]])
    verdict = verify("rejection", torch.tensor([[1]]), target_scores, torch.zeros(1, 1, 3), draft_sampled=False)
    assert verdict.num_accepted.item() == 0 and verdict.bonus.item() != 1


# ---------------------------------------------------------------------------------------------------------------
# Differential fuzzing against plain generate


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A 128-token tokenizer for the tiny targets: single letters, letter pairs, and fillers (stop strings match
    across tokens)."""
    alphabet = "abcdefgh"
    pieces = list(alphabet) + [a + b for a in alphabet for b in alphabet]
    pieces += [f"z{i}" for i in range(128 - len(pieces))]
    model = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="a"))
    model.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    model.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=model)


class SumCriterion(StoppingCriteria):
    """A custom criterion: stop when the last two tokens sum to a multiple of 11. (Plain generate passes scores only
    with output_scores=True; the engine always passes them, row for row.)"""

    def __call__(self, input_ids, scores, **kwargs):
        assert scores is None or scores.shape[0] == input_ids.shape[0]
        return (input_ids[:, -2:].sum(-1) % 11) == 0


@pytest.fixture(scope="module")
def fuzz_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    models_ = {}
    for family in ("qwen3_5", "deepseek_v3"):
        target = load_tiny_target(make_tiny_target(family, root / family))
        target.generation_config.eos_token_id = None
        models_[family] = (target, draft_for(target), draft_for(target, anchor_layout="dflash"))
    return models_, tiny_tokenizer()


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    options = {"max_new_tokens": rng.randint(3, 16)}
    pick = lambda p: rng.random() < p  # noqa: E731
    if pick(0.3):
        options["min_new_tokens"] = rng.randint(1, options["max_new_tokens"])
    if pick(0.15):
        options["min_length"] = rng.randint(2, 20)
    if pick(0.3):
        options["repetition_penalty"] = rng.choice([0.8, 1.2, 1.5])
    if pick(0.25):
        options["no_repeat_ngram_size"] = rng.choice([2, 3])
    if pick(0.2):
        options["bad_words_ids"] = [[rng.randrange(3, 120)], [rng.randrange(3, 120), rng.randrange(3, 120)]]
    if pick(0.2):
        options["sequence_bias"] = {(rng.randrange(3, 120),): 3.0, (rng.randrange(3, 120), rng.randrange(3, 120)): -4.0}
    if pick(0.2):
        options["suppress_tokens"] = rng.sample(range(3, 120), 5)
    if pick(0.15):
        options["begin_suppress_tokens"] = rng.sample(range(3, 120), 3)
    if pick(0.25):
        options["eos_token_id"] = rng.sample(range(3, 120), rng.randint(1, 3))
    if pick(0.15):  # never a suppressed token: generate refuses that combination
        banned = set(options.get("suppress_tokens", [])) | set(options.get("begin_suppress_tokens", []))
        options["forced_eos_token_id"] = rng.choice([t for t in range(3, 120) if t not in banned])
    if pick(0.15):
        options["stop_strings"] = rng.sample(["ab", "hc", "dd", "ge"], rng.randint(1, 2))
    if pick(0.15):
        options["stopping_criteria"] = StoppingCriteriaList([SumCriterion()])
    batch = rng.randint(1, 5)
    prompts = [[rng.randrange(3, 120) for _ in range(rng.randint(1, 8))] for _ in range(batch)]
    return {
        "family": rng.choice(["qwen3_5", "deepseek_v3"]),
        "strategy": rng.choice(["dmtp", "dflash", "mtp1", "mtp4"]),
        "fast_path": pick(0.5),
        "prompts": prompts,
        "oracle_seed": rng.randrange(10**6),
        "options": options,
        "verify_length": rng.choice([None, None, 0, 2, "auto"]),  # drawn last: earlier draws stay as they were
        "static_cache": batch == 1 and pick(0.4),  # drawn after: static caches serve batch size 1
    }


def run_case(fuzz_models, case):
    models_, tokenizer = fuzz_models
    target, dmtp, dflash = models_[case["family"]]
    width = max(len(p) for p in case["prompts"])
    ids = torch.tensor([[0] * (width - len(p)) + p for p in case["prompts"]])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in case["prompts"]])
    options = dict(case["options"], pad_token_id=0)
    if case["static_cache"]:
        options["cache_implementation"] = "static"
    if "stop_strings" in options:
        options["tokenizer"] = tokenizer
    plain = target.generate(ids, attention_mask=mask, do_sample=False, **options)
    fast = {"fixed_shapes": case["fast_path"]}
    drafter = {
        "dmtp": lambda: DMTPDrafter(dmtp, dmtp.native_mtp, **fast),
        "dflash": lambda: DFlashDrafter(dflash, **fast),
        "mtp1": lambda: MTPDrafter(dmtp.native_mtp, 1, **fast),
        "mtp4": lambda: MTPDrafter(dmtp.native_mtp, 4, **fast),
    }[case["strategy"]]()
    # Rows accept different numbers of candidates: part of each proposal is the true continuation.
    references = [plain[b, width - len(p) :][plain[b, width - len(p) :] != 0] for b, p in enumerate(case["prompts"])]
    oracle = BatchOracle(drafter, references, seed=case["oracle_seed"])
    ours = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=oracle,
        do_sample=False,
        dmtp_verify_length=case["verify_length"],
        **options,
    )
    return plain, ours


FUZZ_CASES = int(os.environ.get("DMTP_FUZZ_CASES", "200"))


@pytest.mark.parametrize("seed", range(FUZZ_CASES))
def test_fuzz_speculative_equals_plain_generate(fuzz_models, seed):
    case = random_case(seed)
    plain, ours = run_case(fuzz_models, case)
    assert torch.equal(plain, ours), case


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10_000, 12_000))
def test_fuzz_extended(fuzz_models, seed):
    case = random_case(seed)
    plain, ours = run_case(fuzz_models, case)
    assert torch.equal(plain, ours), case


# ---------------------------------------------------------------------------------------------------------------
# Distributions


def exact_distribution(target, prompt, steps, processors):
    """P(next `steps` tokens) by enumeration, with the processors applied as plain generate applies them."""
    probs = {(): 1.0}
    for _ in range(steps):
        new = {}
        for seq, p in probs.items():
            ids = torch.cat([prompt, torch.tensor([list(seq)], dtype=torch.long)], dim=1)
            with torch.no_grad():
                dist = processors(ids, target(ids).logits[:, -1].float()).softmax(-1)[0]
            for token in range(dist.shape[0]):
                if dist[token] > 0:
                    new[seq + (token,)] = p * float(dist[token])
        probs = new
    return probs


def chi_square_p(counts: dict, exact: dict, runs: int) -> float:
    """Goodness of fit, rare cells merged so every expected count is >= 5; cells with p = 0 must stay empty."""
    from scipy.stats import chisquare

    assert set(counts) <= set(exact), f"sampled a sequence the target cannot produce: {set(counts) - set(exact)}"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for cell in sorted(exact, key=exact.get, reverse=True):
        e = exact[cell] * runs
        if e >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += e
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    total = sum(expected)
    return chisquare(observed, [e * runs / total for e in expected]).pvalue


CUT_PROCESSORS = LogitsProcessorList([TemperatureLogitsWarper(1.3), TopKLogitsWarper(4), TopPLogitsWarper(0.9)])
MIN_P = LogitsProcessorList([TemperatureLogitsWarper(1.2), MinPLogitsWarper(0.15)])
TEMPERATURE = LogitsProcessorList([TemperatureLogitsWarper(1.5)])


def sample_rejection(target, prompt, drafter, steps: int, runs: int, seed: int, processors=None):
    """``runs`` sampled continuations of ``steps`` tokens under rejection verification: (counts per continuation,
    runs in which some draft token was accepted)."""
    counts, accepted = {}, 0
    torch.manual_seed(seed)
    for _ in range(runs):
        out, stats = speculative_decode(
            target,
            prompt,
            drafter,
            max_length=prompt.shape[1] + steps,
            do_sample=True,
            logits_processor=processors if processors is not None else TEMPERATURE,
            verify_mode="rejection",
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(stats.hist[1:]) > 0
    return counts, accepted


@pytest.mark.parametrize(
    "name,strategy,processors,extra",
    [
        ("top-k + top-p", "dmtp", CUT_PROCESSORS, {}),
        ("min-p", "dflash", MIN_P, {}),
        ("greedy drafts under rejection", "dflash", TEMPERATURE, {"draft_sampling": False}),
        ("fast path", "mtp", MIN_P, {"fast_path": True}),
        ("block verification", "dmtp", CUT_PROCESSORS, {"verify_mode": "block"}),
        ("block verification, greedy drafts", "dflash", TEMPERATURE, {"verify_mode": "block", "draft_sampling": False}),
        ("block verification, MTP-2", "mtp", MIN_P, {"verify_mode": "block"}),
    ],
)
def test_sampled_output_has_the_targets_distribution(vocab6, name, strategy, processors, extra):
    target, prompt, steps, runs = vocab6, torch.tensor([[1, 2, 0]]), 2, 700
    exact = exact_distribution(target, prompt, steps, processors)
    if processors is not TEMPERATURE:
        assert len(exact_distribution(target, prompt, 1, processors)) < 6  # the processors forbid tokens (p = 0)
    drafter = _tiny_vocab_drafter(target, strategy)
    if extra.get("fast_path"):
        drafter.fixed_shapes = True
    counts, accepted = {}, 0
    torch.manual_seed(99)
    for _ in range(runs):
        out, stats = speculative_decode(
            target,
            prompt,
            drafter,
            max_length=prompt.shape[1] + steps,
            do_sample=True,
            logits_processor=processors,
            verify_mode=extra.get("verify_mode", "rejection"),
            draft_sampling=extra.get("draft_sampling"),
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += stats.hist[1:] != [0] * (len(stats.hist) - 1)
    assert accepted > runs // 20  # drafts were really accepted, not only corrected
    assert chi_square_p(counts, exact, runs) > 1e-3, name


def test_batched_rows_each_have_the_targets_distribution(vocab6):
    target, steps, runs = vocab6, 2, 600
    prompts = [[1, 2, 0], [4, 3]]
    ids = torch.tensor([[1, 2, 0], [0, 4, 3]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    exact = [exact_distribution(target, torch.tensor([p]), steps, CUT_PROCESSORS) for p in prompts]
    drafter = _tiny_vocab_drafter(target, "dmtp")
    counts = [{}, {}]
    torch.manual_seed(7)
    for _ in range(runs):
        out, _ = speculative_decode(
            target,
            ids,
            drafter,
            max_length=3 + steps,
            attention_mask=mask,
            do_sample=True,
            logits_processor=CUT_PROCESSORS,
            verify_mode="rejection",
            pad_token_id=5,
        )
        for row in range(2):
            key = tuple(out[row, 3:].tolist())
            counts[row][key] = counts[row].get(key, 0) + 1
    for row in range(2):
        assert chi_square_p(counts[row], exact[row], runs) > 1e-3, row


def test_transformers_loop_with_sampling_has_the_targets_distribution(vocab6):
    target, prompt, steps, runs = vocab6, torch.tensor([[1, 2, 0]]), 2, 600
    exact = exact_distribution(target, prompt, steps, LogitsProcessorList([TemperatureLogitsWarper(1.5)]))
    drafter = _tiny_vocab_drafter(target, "dmtp")
    counts = {}
    torch.manual_seed(5)
    for _ in range(runs):
        out = generate_with_transformers_loop(
            target,
            prompt,
            drafter,
            do_sample=True,
            temperature=1.5,
            top_k=None,
            top_p=None,
            max_new_tokens=steps,
            pad_token_id=5,
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, exact, runs) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs


def test_right_padded_batch_is_refused_with_the_fix(targets):
    target = targets["qwen3_5"]
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    draft = draft_for(target)  # binding routes target.generate
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4)


def test_flash_attention_target_with_a_batch_is_refused_before_prefill(tmp_path):
    target = load_tiny_target(make_tiny_target("qwen3_5", tmp_path / "t"))
    draft = draft_for(target)
    target.config._attn_implementation = "flash_attention_2"  # the kernel is never reached: the check comes first
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    with pytest.raises(NotImplementedError, match="Qwen3_5ForCausalLM.*attn_implementation='sdpa'"):
        speculative_decode(
            target,
            ids,
            DMTPDrafter(draft, draft.native_mtp),
            max_length=8,
            attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        )


def test_fixed_slots_too_small_fail_before_any_write(targets):
    target = targets["qwen3_5"]
    draft = draft_for(target)
    drafter = DMTPDrafter(draft, draft.native_mtp, fixed_shapes=True)
    drafter.reserve = lambda max_positions: setattr(drafter, "capacity", 6)  # a caller that reserved too little
    with pytest.raises(ValueError, match="fixed slots per row"):
        speculative_decode(target, torch.tensor([[5, 6, 7, 8, 9, 10]]), drafter, max_length=12)


def test_prefix_free_processors_never_read_input_ids():
    """The processors run once over a whole round (`process_flat`) are exactly those whose output does not depend on
    input_ids at all; anything else, a user processor included, is called per position with its exact prefix."""
    from transformers import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        InfNanRemoveLogitsProcessor,
        LogitNormalization,
        LogitsProcessor,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    from dmtp_hf.assistant.accept.processing import _PREFIX_FREE, process_flat, reads_input_ids

    free = [
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(5),
        TopPLogitsWarper(0.8),
        MinPLogitsWarper(0.1),
        TypicalLogitsWarper(0.9),
        EpsilonLogitsWarper(3e-2),
        EtaLogitsWarper(3e-2),
        LogitNormalization(),
        InfNanRemoveLogitsProcessor(),
        SuppressTokensLogitsProcessor([1, 2]),
    ]
    assert {type(p) for p in free} == set(_PREFIX_FREE)
    scores = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(0))
    history = torch.randint(0, 40, (12, 9), generator=torch.Generator().manual_seed(1))
    for processor in free:
        processors = LogitsProcessorList([processor])
        assert not reads_input_ids(processors)
        with_history = processors(history, scores.reshape(12, 40).clone()).view(3, 4, 40)
        torch.testing.assert_close(process_flat(scores, processors), with_history, rtol=0, atol=0)

    class Passthrough(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    declared = Passthrough()
    declared.reads_input_ids = False
    assert reads_input_ids(LogitsProcessorList([Passthrough()]))
    assert reads_input_ids(LogitsProcessorList([TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.3)]))
    assert not reads_input_ids(LogitsProcessorList([declared, TemperatureLogitsWarper(0.7)]))


def test_block_verification_accepts_at_least_as_many_tokens_as_rejection():
    """Block verification is never worse than token-wise rejection in expected accepted tokens (Sun et al.): the
    same target/draft distributions and the same drafted blocks of 6, 40,000 rows per mode in one call each, on
    draws where the two differ (a draft that over-weights some tokens, so token-wise rejection often stops early)."""
    rows, num_candidates, vocab = 40_000, 6, 6
    for seed in (5, 6):
        generator = torch.Generator().manual_seed(seed)
        p_logits = torch.randn(1, num_candidates + 1, vocab, generator=generator) * 1.5
        q_logits = p_logits[:, :num_candidates] + torch.randn(1, num_candidates, vocab, generator=generator) * 1.5
        q = q_logits.softmax(-1).expand(rows, -1, -1)
        candidates = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).view(rows, num_candidates)
        accepted = {}
        for mode in ("rejection", "block"):
            torch.manual_seed(11)
            verdict = verify(mode, candidates, p_logits.expand(rows, -1, -1), q_logits.expand(rows, -1, -1))
            accepted[mode] = verdict.num_accepted.float()
        gap = accepted["block"].mean() - accepted["rejection"].mean()
        standard_error = ((accepted["block"].var() + accepted["rejection"].var()) / rows).sqrt()
        assert gap > 5 * standard_error, (seed, gap, standard_error)  # measured: 23 and 32 standard errors
