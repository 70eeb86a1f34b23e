"""How many candidates a round verifies (``verify_length``): a fixed number or chosen per round ("auto").

- Lossless at every width: greedy output equals plain ``generate`` for every strategy, one row and ragged batches,
  with the fast path on and off, whatever width each round takes (0 included: a plain decoding step).
- Sampled output keeps the target's distribution when widths vary round to round (chi-square).
- The choice itself: `AutoWidth.best` follows confidence and cost; `Calibration` is monotone, fits what it saw and
  travels with the draft's checkpoint; bad values are refused before any forward.
"""

import json
import math
import random
import shutil

import pytest
import torch
from conftest import draft_for
from test_batching import BatchOracle, _batch, _prompts
from test_engine import MAX_NEW, OracleMix, _tiny_vocab_drafter, greedy_reference, strategies
from test_lossless import CUT_PROCESSORS, chi_square_p, exact_distribution
from transformers import StaticCache

from dmtp_hf import DMTPDraftModel
from dmtp_hf.assistant import SpecStats, speculative_decode
from dmtp_hf.assistant import widths as widths_module
from dmtp_hf.assistant.drafters.dmtp import DMTPDrafter
from dmtp_hf.assistant.drafters.mtp import MTPDrafter
from dmtp_hf.assistant.widths import AutoWidth, Calibration, CostModel, width_policy
from dmtp_hf.cli import main
from dmtp_hf.evaluation.calibration import reliability, split_pairs
from dmtp_hf_assets.tiny_targets import load_tiny_target


class RandomWidths(AutoWidth):
    """An auto-width policy that picks a seeded random width every time it is asked, so a run takes every width
    (and DMTP skips its DFlash forward, MTP chains stop early) in an unpredictable order."""

    def __init__(self, max_candidates: int, seed: int = 0):
        super().__init__(CostModel({1: 1.0}), Calibration(), max_candidates)
        self.rng = random.Random(seed)

    def best(self, known, draft_stages, drafted=0):
        return self.rng.randint(0, self.max_candidates)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("fast_path", [False, True])
def test_greedy_identical_at_every_width(targets, family, fast_path):
    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = greedy_reference(target, prompt)
    for name, drafter in strategies(target).items():
        drafter.fixed_shapes = fast_path
        for verify_length in (0, 2, "auto", RandomWidths(drafter.num_candidates, seed=len(name))):
            out, stats = speculative_decode(
                target,
                prompt,
                OracleMix(drafter, reference, seed=3),
                max_length=reference.shape[1],
                verify_length=verify_length,
            )
            assert torch.equal(out, reference), (family, name, verify_length)
            generated = reference.shape[1] - prompt.shape[1]
            if verify_length == 0:  # every round is a plain decoding step (the prefill gives the first token)
                assert stats.num_rounds == generated - 1 and stats.hist[1:] == [0] * (len(stats.hist) - 1)
            if isinstance(verify_length, AutoWidth) or verify_length == "auto":
                assert sum(stats.verify_widths.values()) >= stats.num_rounds - 1, stats.verify_widths
            if isinstance(verify_length, RandomWidths):
                assert len(stats.verify_widths) >= min(3, drafter.num_candidates + 1), (name, stats.verify_widths)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_greedy_identical_at_every_width_with_a_static_cache(targets, family):
    """A static cache (batch size 1) at every width, 0 included: a width-0 round is a 1-token verify, for which
    Transformers builds no mask when the cache does not say it is compileable (a hybrid target's, while its
    linear-attention layers record their past), and the token must still not see the cache's unwritten slots.
    A left-padded row and ``generate(cache_implementation="static")`` take the same path."""
    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = greedy_reference(target, prompt, max_new_tokens=16, cache_implementation="static")
    for name, drafter in strategies(target).items():
        if name == "mtp1":  # the MTP head's path is mtp4's, one step shorter
            continue
        widths = [0, RandomWidths(drafter.num_candidates, seed=len(name))] + (["auto"] if name == "dmtp" else [])
        for verify_length in widths:
            out, _ = speculative_decode(
                target,
                prompt,
                OracleMix(drafter, reference, seed=3),
                max_length=reference.shape[1],
                cache=StaticCache(config=target.config, max_cache_len=64),
                verify_length=verify_length,
            )
            assert torch.equal(out, reference), (family, name, verify_length)
    padded, mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), prompt], dim=1), torch.tensor([[0, 0] + [1] * 7])
    static = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, cache_implementation="static")
    plain = target.generate(padded, **static)
    draft = draft_for(target, anchor_layout="dflash")
    for verify_length in (0, None):
        ours = target.generate(padded, assistant_model=draft, dmtp_verify_length=verify_length, **static)
        assert torch.equal(ours, plain), (family, verify_length)


def test_dmtp_skips_its_dflash_forward_when_t1_alone_is_the_bet(targets):
    target = targets["qwen3_5"]
    draft = draft_for(target)
    calls = []
    handle = draft.register_forward_hook(lambda *args: calls.append(1))
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = greedy_reference(target, prompt)
    try:
        for verify_length in (None, 1, RandomWidths(7, seed=1)):
            calls.clear()
            out, stats = speculative_decode(
                target,
                prompt,
                DMTPDrafter(draft, draft.native_mtp),
                max_length=reference.shape[1],
                verify_length=verify_length,
            )
            assert torch.equal(out, reference)
            proposals = stats.num_rounds
            if verify_length is None:
                assert len(calls) >= proposals  # one DFlash forward per round (plus the context prefill)
            elif verify_length == 1:
                assert len(calls) <= 1  # T1 alone: never a DFlash forward beyond the prefill
            else:
                assert stats.skipped_drafts > 0 and len(calls) <= proposals - stats.skipped_drafts + 1
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_ragged_batches_with_random_widths_equal_single_rows(targets, family):
    target = targets[family]
    draft = draft_for(target)
    prompts = _prompts(4, seed=11)
    singles = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompts]
    ids, mask = _batch(prompts, pad=0)
    for name, drafter in {
        "dmtp": DMTPDrafter(draft, draft.native_mtp),
        "mtp3": MTPDrafter(draft.native_mtp, 3),
    }.items():
        stats = SpecStats(drafter.num_candidates, name)
        out, stats = speculative_decode(
            target,
            ids,
            BatchOracle(drafter, singles, seed=5),
            max_length=ids.shape[1] + MAX_NEW,
            attention_mask=mask,
            pad_token_id=0,
            stats=stats,
            verify_length=RandomWidths(drafter.num_candidates),
        )
        for row, prompt in enumerate(prompts):
            expected = singles[row][len(prompt) :]
            assert torch.equal(out[row, ids.shape[1] : ids.shape[1] + expected.shape[0]], expected), (name, row)


@pytest.mark.parametrize("mode", ["rejection", "block"])
def test_sampled_output_keeps_the_distribution_when_widths_vary(vocab6, mode):
    target, prompt, steps, runs = vocab6, torch.tensor([[1, 2, 0]]), 2, 500
    exact = exact_distribution(target, prompt, steps, CUT_PROCESSORS)
    drafter = _tiny_vocab_drafter(target, "dmtp")
    policy = RandomWidths(drafter.num_candidates, seed=4)
    counts = {}
    torch.manual_seed(5)
    for _ in range(runs):
        out, _ = speculative_decode(
            target,
            prompt,
            drafter,
            max_length=prompt.shape[1] + steps,
            do_sample=True,
            logits_processor=CUT_PROCESSORS,
            verify_mode=mode,
            verify_length=policy,
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, exact, runs) > 1e-3


def test_auto_width_follows_confidence_and_cost():
    cheap = CostModel({1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06})  # verifying more tokens costs almost nothing
    policy = AutoWidth(cheap, Calibration(), 3)
    assert policy.best(torch.full((2, 3), 0.95), [[]] * 4) == 3
    assert policy.best(torch.full((2, 3), 0.001), [[]] * 4) == 0
    assert policy.best(torch.tensor([[0.95, 0.9, 0.001]]), [[]] * 4) == 2
    steep = CostModel({1: 1.0, 2: 1.9, 3: 2.8, 4: 3.7})  # every verified token costs nearly a whole forward
    assert AutoWidth(steep, Calibration(), 3).best(torch.full((1, 3), 0.6), [[]] * 4) == 0
    slow_draft = CostModel({1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06})
    slow_draft.update("dflash", 5.0)  # a drafter stage that costs more than it can return
    stages = [[], [], ["dflash"], ["dflash"]]
    assert AutoWidth(slow_draft, Calibration(), 3).best(torch.full((1, 3), 0.9), stages) == 1
    # what the rounds accepted moves the prior of candidates the draft has not yet scored
    policy.prior = [0.5] * 3
    policy.observe(torch.full((4, 2), 0.5), torch.tensor([2, 2, 2, 2]))
    assert policy.prior[0] > 0.5 and policy.prior[1] > 0.5 and policy.prior[2] == 0.5
    # an unseen draft is tried before it is judged; evidence moves the estimate at once, then as a moving average
    fresh = AutoWidth(cheap, Calibration(), 3)
    assert fresh.prior == [widths_module.PRIOR_ACCEPTANCE] * 3
    fresh.observe(torch.full((4, 3), 0.5), torch.tensor([0, 0, 0, 0]))
    assert fresh.prior[0] < 0.35 and fresh.prior[1] == widths_module.PRIOR_ACCEPTANCE
    # drafted but cut to width 0 (nothing verified): a calibration's predictions teach the priors that drafting
    # does not pay; an uncalibrated draft's predictions are its priors rescaled, no evidence, and leave them alone
    weak = Calibration.fit([(j, 0.5, False) for j in range(3) for _ in range(20)])
    cut = AutoWidth(steep, weak, 3)
    cut.observe(torch.empty(4, 0), torch.zeros(4, dtype=torch.long), predicted=torch.full((4, 3), 0.05))
    assert all(p < 0.35 for p in cut.prior) and cut.best(torch.empty(1, 0), [[]] * 4) == 0
    uncalibrated = AutoWidth(steep, Calibration(), 3)
    uncalibrated.observe(torch.empty(4, 0), torch.zeros(4, dtype=torch.long), predicted=torch.full((4, 3), 0.05))
    assert uncalibrated.prior == [widths_module.PRIOR_ACCEPTANCE] * 3


def test_auto_drafts_only_when_it_pays_and_probes_at_doubling_intervals():
    steep = CostModel({1: 1.0, 2: 1.9, 3: 2.8, 4: 3.7})
    policy = AutoWidth(steep, Calibration(), 3)
    policy.prior = [0.05] * 3  # what a weak draft's rounds taught it
    decisions, full_blocks = [], []
    for _ in range(31):
        decisions.append(policy.drafts(2, [[]] * 4))
        full_blocks.append(policy.best(torch.empty(2, 0), [[]] * 4) == 3)
    probes = [i for i, drafts in enumerate(decisions) if drafts]
    assert probes == [1, 5, 13, 29]  # after 2, 4, 8 and 16 plain rounds
    assert full_blocks == decisions  # a probe verifies the whole block
    assert policy.widths == [0] * (31 - len(probes)) and policy.plain == policy.skipped == 31 - len(probes)
    policy.prior = [0.95] * 3  # the text turned predictable: every round drafts, the interval starts over
    assert all(policy.drafts(2, [[]] * 4) for _ in range(5)) and policy.probe_interval == 2


def test_probes_lose_at_most_the_exploration_share_and_their_schedule_outlives_the_call(targets):
    def probes(cost: CostModel, rounds: int, policy: AutoWidth | None = None) -> list[int]:
        policy = policy or AutoWidth(cost, Calibration(), 3)
        policy.prior[:] = [0.05] * policy.max_candidates
        return [i for i in range(rounds) if policy.drafts(1, [[]] * (policy.max_candidates + 1))]

    # a probe here loses ~2.6 plain steps: past 32 the interval keeps doubling (to ~130 rounds at 2 % exploration)
    assert probes(CostModel({1: 1.0, 2: 1.9, 3: 2.8, 4: 3.7}), 200) == [1, 5, 13, 29, 61, 125]
    # a cheap probe (~0.2 steps lost) stops doubling at 32
    assert probes(CostModel({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}), 200) == [1, 5, 13, 29, 61, 93, 125, 157, 189]
    # the next call for the same draft continues the schedule instead of probing again after two rounds
    target = targets["qwen3_5"]
    draft = draft_for(target)
    drafter = DMTPDrafter(draft, draft.native_mtp)
    first = width_policy("auto", target, drafter, 1)
    first.cost = CostModel({w: 1.0 + 0.9 * (w - 1) for w in range(1, 9)})  # the tiny target's is nearly flat
    assert probes(first.cost, 40, first) == [1, 5, 13, 29]
    second = width_policy("auto", target, drafter, 1)
    assert (second.probe_interval, second.since_probe) == (first.probe_interval, first.since_probe) == (32, 10)
    assert second.prior is first.prior


def test_rounds_where_drafting_does_not_pay_run_no_drafter_stage(targets, monkeypatch):
    """A weak draft under ``auto``: most rounds are plain decoding steps that run neither the MTP head's prediction
    nor the DFlash forward (only the state is kept), the output still the plain one."""
    from dmtp_hf.assistant.drafters.state import MTPState

    target = targets["qwen3_5"]
    draft = draft_for(target)
    predictions, dflash_calls = [], []
    predict = MTPState.predict
    monkeypatch.setattr(MTPState, "predict", lambda self: predictions.append(1) or predict(self))
    handle = draft.register_forward_hook(lambda *args: dflash_calls.append(1))
    head_calls = []
    head_handle = draft.native_mtp.register_forward_hook(lambda *args: head_calls.append(1))
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = greedy_reference(target, prompt)
    steep = CostModel({w: 1.0 + 0.9 * (w - 1) for w in range(1, 9)}, follow_rounds=False)  # not the tiny target's
    policy = AutoWidth(steep, Calibration(), 7)
    policy.prior = [0.02] * 7
    try:
        out, stats = speculative_decode(
            target, prompt, DMTPDrafter(draft, draft.native_mtp), max_length=reference.shape[1], verify_length=policy
        )
    finally:
        handle.remove(), head_handle.remove()
    assert torch.equal(out, reference)
    drafted = stats.num_rounds - stats.plain_rounds
    assert stats.num_rounds > 20 and drafted <= 5, (stats.num_rounds, stats.plain_rounds)
    assert len(predictions) <= drafted and len(dflash_calls) <= drafted + 1  # + the context prefill
    # plain rounds only queue their pairs for the MTP head: one forward per drafting round feeds them all
    assert len(head_calls) <= drafted + 1, (len(head_calls), drafted)  # + the prompt's pairs


def test_a_call_ending_on_a_drafted_round_leaves_nothing_for_the_next_call(targets):
    """The last round of a call proposes and is verified, but the drafter never advances past it: its confidences
    (three rows here), kept by that call's width policy, must not reach the next call's first plain round (two rows),
    which would learn from them."""
    target = targets["qwen3_5"]
    draft = draft_for(target)
    drafter = DMTPDrafter(draft, draft.native_mtp)
    costs = CostModel({w: 1.0 + 0.05 * (w - 1) for w in range(1, 9)})  # a wide verify costs about one step
    first = torch.tensor([[5, 17, 42, 9], [8, 3, 61, 2], [40, 41, 7, 19]])
    strong = AutoWidth(costs, Calibration(), 7)
    strong.prior = [0.9] * 7  # the first call's one round drafts
    out, _ = speculative_decode(target, first, drafter, max_length=first.shape[1] + 2, verify_length=strong)
    assert torch.equal(out, greedy_reference(target, first, max_new_tokens=2))
    assert strong.pending is not None and strong.pending[0].shape[0] == 3  # the call ended on a drafted round
    weak = AutoWidth(costs, Calibration(), 7)
    weak.prior = [0.02] * 7  # the next call's first round is plain: nothing of its own overwrites the leftovers
    second = first[:2]
    out, stats = speculative_decode(target, second, drafter, max_length=second.shape[1] + MAX_NEW, verify_length=weak)
    assert torch.equal(out, greedy_reference(target, second)) and stats.plain_rounds > 0


def test_calibration_is_monotone_fits_what_it_saw_and_round_trips(tmp_path, targets):
    rng = random.Random(0)
    pairs = []
    for _ in range(4000):
        position, conf = rng.randrange(2), rng.random()
        truth = conf**2 if position == 0 else 0.5 * conf  # P(accepted | confidence) per position
        pairs.append((position, conf, rng.random() < truth))
    calibration = Calibration.fit(pairs, num_bins=10)
    for rates in calibration.rates:
        assert all(a <= b + 1e-9 for a, b in zip(rates, rates[1:], strict=False)), rates
    got = calibration(torch.tensor([[0.95, 0.95], [0.15, 0.15]]))
    assert abs(float(got[0, 0]) - 0.95**2) < 0.08 and abs(float(got[0, 1]) - 0.475) < 0.08
    assert float(got[1, 0]) < 0.1 and float(got[1, 1]) < 0.15
    assert torch.equal(Calibration.from_dict(calibration.to_dict())(got), calibration(got))
    # the held-out base rate per position (E[conf^2] = 1/3, E[conf / 2] = 1/4) round-trips and seeds the priors
    assert calibration.base_rates == pytest.approx([1 / 3, 1 / 4], abs=0.03)
    assert Calibration.from_dict(calibration.to_dict()).base_rates == calibration.base_rates
    assert AutoWidth(CostModel({1: 1.0}), calibration, 3).prior == [*calibration.base_rates, calibration.base_rates[-1]]
    assert Calibration.from_dict({"edges": [1.0], "rates": [[0.5]]}).base_rates == []  # fits from before base rates
    # a draft known to be weak runs plain from its first round instead of being tried in full first
    cost = CostModel({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9})
    assert not AutoWidth(cost, Calibration([1.0], [[0.02]] * 3, [0.02] * 3), 3).drafts(1, [[]] * 4)
    assert AutoWidth(cost, Calibration([1.0], [[0.02]] * 3), 3).drafts(1, [[]] * 4)  # no base rates: tried first
    # judged on pairs it was not fitted on, the fit beats the raw confidence (which over-predicts here)
    fit, held = split_pairs(pairs, 0.25)
    for row in reliability(Calibration.fit(fit), held):
        assert row["brier_calibrated"] < row["brier_confidence"], row
        assert all(abs(point["predicted"] - point["observed"]) < 0.12 for point in row["curve"] if point["count"] > 50)
    # stored in the draft's config, it is what "auto" decodes with after save/load
    target = targets["qwen3_5"]
    draft = draft_for(target)
    draft.config.dmtp_config["acceptance_calibration"] = calibration.to_dict()
    draft.save_pretrained(tmp_path / "draft")
    loaded = DMTPDraftModel.from_pretrained(tmp_path / "draft", target=target)
    policy = width_policy("auto", target, DMTPDrafter(loaded, loaded.native_mtp), 1)
    assert policy.calibration.to_dict() == calibration.to_dict()


def test_target_costs_are_measured_once_per_target_and_batch(targets, monkeypatch):
    target = targets["deepseek_v3"]
    timed = []
    real = widths_module._time_widths
    monkeypatch.setattr(widths_module, "_COSTS", {})
    monkeypatch.setattr(widths_module, "_time_widths", lambda *a, **k: timed.append(a[1]) or real(*a, **k))
    first = CostModel.measure(target, 1, 4, repeats=1, context=8)
    CostModel.measure(target, 1, 4, repeats=1, context=8)
    CostModel.measure(target, 2, 4, repeats=1, context=8)
    CostModel.measure(target, 1, 2, repeats=1, context=8)  # a narrower drafter: what was measured covers it
    assert timed == [1, 2]
    assert sorted(CostModel.measure(target, 1, 6, repeats=1, context=8).verify) == [1, 2, 3, 4, 5, 6]  # wider
    assert sorted(first.verify) == [1, 2, 3, 4] and all(seconds > 0 for seconds in first.verify.values())
    costs = [first.verify[w] for w in sorted(first.verify)]
    assert costs == sorted(costs)  # noise never makes a wider forward look cheaper


@pytest.mark.parametrize("bad", [-1, 2.5, "fast", True])
def test_bad_verify_length_is_refused_before_any_forward(targets, bad):
    target = targets["deepseek_v3"]
    draft = draft_for(target)
    calls = []
    handle = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="verify_length"):
            speculative_decode(
                target, torch.tensor([[1, 2, 3]]), DMTPDrafter(draft, draft.native_mtp), max_length=8, verify_length=bad
            )
    finally:
        handle.remove()
    assert not calls


def test_calibrate_fits_stores_and_auto_reads_it(models_dir, tmp_path, capsys):
    draft_dir = tmp_path / "dmtp"
    shutil.copytree(models_dir / "dmtp", draft_dir)
    argv = [
        "calibrate",
        "--target",
        str(models_dir / "target"),
        "--draft",
        str(draft_dir),
        "--strategies",
        "dmtp",
        "--datasets",
        "gsm8k",
        "--limit",
        "2",
        "--max-new-tokens",
        "12",
        "--output-dir",
        str(tmp_path / "out"),
        "--no-progress",
        "--write",
    ]
    assert main(argv) == 0
    assert "Brier" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "calibration.json").read_text())["dmtp"]
    assert (tmp_path / "out" / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    rows = report["positions"]
    assert rows[0]["tested"] > 0 and all(0 <= row["brier_calibrated"] <= 1 for row in rows)
    assert report["held_out"] == round(0.25 * report["pairs"])
    stored = json.loads((draft_dir / "config.json").read_text())["dmtp_config"]["acceptance_calibration"]
    assert stored == {"edges": report["edges"], "rates": report["rates"], "base_rates": report["base_rates"]}
    assert len(stored["base_rates"]) == len(stored["rates"]) and all(0 <= r <= 1 for r in stored["base_rates"])
    target = load_tiny_target(models_dir / "target")
    draft = DMTPDraftModel.from_pretrained(draft_dir, target=target)
    assert width_policy("auto", target, DMTPDrafter(draft, draft.native_mtp), 1).calibration.rates == stored["rates"]


def test_eval_compares_fixed_and_auto_widths_side_by_side(models_dir, tmp_path):
    argv = [
        "eval",
        "--target",
        str(models_dir / "target"),
        "--draft",
        str(models_dir / "dmtp"),
        "--strategies",
        "dmtp,dmtp:auto,mtp2:1",
        "--datasets",
        "gsm8k",
        "--limit",
        "2",
        "--max-new-tokens",
        "12",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--no-baseline",
    ]
    assert main(argv) == 0
    data = json.loads((tmp_path / "eval.json").read_text())
    strategies = {s["label"]: s for s in data["strategies"]}
    assert [strategies[label]["verify_length"] for label in ("dmtp", "dmtp:auto", "mtp2:1")] == [None, "auto", 1]
    results = data["results"]["gsm8k"]
    assert data["outputs_identical"]["gsm8k"]  # every width is lossless
    assert not results["dmtp"]["verify_widths"] and sum(results["dmtp:auto"]["verify_widths"].values()) > 0
    assert max(len(r["hist"]) for r in results["mtp2:1"]["requests"]) == 3  # K = 2 slots: never more than 1 accepted
    assert results["mtp2:1"]["hist"][2] == 0


def test_target_generate_takes_dmtp_verify_length(targets):
    target = targets["qwen3_5"]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = greedy_reference(target, prompt, max_new_tokens=10)
    out = target.generate(
        prompt,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=10,
        dmtp_verify_length="auto",
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference)
    assert sum(out.spec_stats.verify_widths.values()) == out.spec_stats.num_rounds
    with pytest.raises(ValueError, match="verify_length"):
        target.generate(prompt, assistant_model=draft, max_new_tokens=4, dmtp_verify_length=-2)


def _round(policy, confidence: float, batch: int = 1):
    """One round driven through the policy's questions, with K candidates of the given confidence (vocab 4)."""
    if not policy.begin_round(batch):
        return 0
    k = policy.max_candidates
    scores = torch.zeros(batch, k, 4)
    scores[..., 0] = math.log(3 * confidence / (1 - confidence))  # softmax(scores)[..., 0] == confidence
    tokens = torch.zeros(batch, k, dtype=torch.long)
    return policy.choose(tokens, scores)


def test_auto_follows_what_rounds_really_cost_without_reading_a_clock():
    """Synthetic costs through the statistics' timer: when the widest verify starts costing 3x its timing (a busy
    machine slows a wide CPU forward more than a short one), auto stops choosing it within a few rounds, and chooses
    it again within a few more once it is cheap again. The policy reads no clock: the seconds here are made up."""
    timed = {w: 1.0 + 0.05 * (w - 1) for w in range(1, 5)}  # a wide verify costs about one step
    policy = AutoWidth(CostModel(timed), Calibration(), 3, [[]] * 4)
    policy.prior = [0.7] * 3
    policy.mean_confidence = [0.7] * 3
    confident = []  # the widths of the rounds whose candidates are confident (every other round)
    for round_index in range(60):
        confidence = 0.9 if round_index % 2 == 0 else 0.3
        width = _round(policy, confidence)
        dear = 3.0 if 10 <= round_index < 30 and width == 3 else 1.0
        policy.timed("verify", timed[width + 1] * dear)
        policy.learn([width + 1 if confidence > 0.5 else 1])
        if confidence > 0.5 and not policy.probing:  # (every few rounds one verifies the whole block anyway)
            confident.append(width)
    assert confident[:5] == [3] * 5, confident  # cheap: the whole block
    assert confident[7:15] == [2] * 8, confident  # the widest verify turned dear: one narrower, within two rounds
    assert confident[-5:] == [3] * 5, confident  # cheap again: the whole block again


def test_machine_load_moves_every_width_estimate():
    cost = CostModel({1: 1.0, 2: 1.1, 3: 1.2})
    for _ in range(20):
        cost.observe_verify(1, 2.0)  # only plain steps run, at twice their timing
    assert cost.verify[1] == pytest.approx(2.0, rel=0.05) and cost.load == pytest.approx(2.0, rel=0.05)
    assert cost.verify[3] == pytest.approx(2.4, rel=0.05)  # never observed: follows the load


def repetitive_prompt() -> torch.Tensor:
    """A prompt that repeats itself, so prompt lookup has matches from the first round on."""
    return torch.tensor([[5, 17, 42, 9, 77, 3, 5, 17, 42, 9, 77, 3, 5, 17, 42]])


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_prompt_lookup_competes_with_the_draft_and_output_is_unchanged(targets, family):
    """``verify_length="auto"`` with prompt lookup (its default): some rows of some rounds verify lookup's copied
    tokens instead of the draft's, and greedy output is plain ``generate``'s, one row and a ragged batch."""
    target = targets[family]
    prompt = repetitive_prompt()
    reference = greedy_reference(target, prompt)
    draft = draft_for(target)
    for drafter in (DMTPDrafter(draft, draft.native_mtp), MTPDrafter(draft.native_mtp, 3)):
        policy = RandomWidths(drafter.num_candidates, seed=2)
        out, _ = speculative_decode(target, prompt, drafter, max_length=reference.shape[1], verify_length=policy)
        assert torch.equal(out, reference), (family, drafter.name)
        assert policy.lookup_rows > 0 and policy.lookup_estimate.seen[0] > 0, (drafter.name, policy.lookup_rows)
    prompts = [prompt[0].tolist(), prompt[0, 3:].tolist()]
    singles = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompts]
    ids, mask = _batch(prompts, pad=0)
    policy = RandomWidths(draft.config.num_candidates, seed=3)
    out, _ = speculative_decode(
        target,
        ids,
        DMTPDrafter(draft, draft.native_mtp),
        max_length=ids.shape[1] + MAX_NEW,
        attention_mask=mask,
        pad_token_id=0,
        verify_length=policy,
    )
    for row, single in enumerate(singles):
        expected = single[len(prompts[row]) :]
        assert torch.equal(out[row, ids.shape[1] : ids.shape[1] + expected.shape[0]], expected), row
    assert policy.lookup_rows > 0


def test_prompt_lookup_is_off_on_request_and_refused_with_a_fixed_width(targets):
    target = targets["qwen3_5"]
    draft = draft_for(target)
    drafter = DMTPDrafter(draft, draft.native_mtp)
    policy = RandomWidths(drafter.num_candidates)
    speculative_decode(target, repetitive_prompt(), drafter, max_length=24, verify_length=policy, prompt_lookup=False)
    assert policy.lookup_rows == 0
    with pytest.raises(ValueError, match="prompt_lookup=True needs verify_length='auto'"):
        speculative_decode(target, repetitive_prompt(), drafter, max_length=24, verify_length=2, prompt_lookup=True)


@pytest.mark.parametrize("mode", ["rejection", "block"])
def test_sampled_output_keeps_the_distribution_with_prompt_lookup_rows(vocab6, mode):
    """Rows that verify prompt lookup's copied tokens (a one-hot ``q``) next to the draft's: the distribution of
    what is sampled is still the target's."""
    target, prompt, steps, runs = vocab6, torch.tensor([[1, 2, 0, 1, 2, 0, 1, 2]]), 2, 500
    exact = exact_distribution(target, prompt, steps, CUT_PROCESSORS)
    drafter = _tiny_vocab_drafter(target, "dmtp")
    policy = RandomWidths(drafter.num_candidates, seed=6)
    counts = {}
    torch.manual_seed(7)
    for _ in range(runs):
        out, _ = speculative_decode(
            target,
            prompt,
            drafter,
            max_length=prompt.shape[1] + steps,
            do_sample=True,
            logits_processor=CUT_PROCESSORS,
            verify_mode=mode,
            verify_length=policy,
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert policy.lookup_rows > runs // 10, policy.lookup_rows  # enough copied rows to have been tested
    assert chi_square_p(counts, exact, runs) > 1e-3


def test_eval_labels_name_auto_with_and_without_prompt_lookup():
    """``dmtp:auto`` lets prompt lookup compete (the default), ``dmtp:auto-draft`` is the draft alone under
    ``auto``; fixed widths never take lookup."""
    from dmtp_hf.evaluation.models import lookup_of, split_width

    assert split_width("dmtp:auto") == ("dmtp", "auto") and lookup_of("dmtp:auto") is None
    assert split_width("dmtp:auto-draft") == ("dmtp", "auto") and lookup_of("dmtp:auto-draft") is False
    assert split_width("mtp4:2") == ("mtp4", 2) and lookup_of("mtp4:2") is None
