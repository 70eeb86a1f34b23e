"""The shared speculation policy (``dmtp_policy``): its pieces against brute force, and the per-request policy of
the vLLM plugin in a simulated engine with injected costs (no clock is read; every figure is exact).

The simulated engine runs steps of B requests. Each step, for each request, the world draws the draft's confidence
in each of its K proposals (noisy around per-position rates) and how many of them the target accepts (each with the
probability the draft gave it) and
whether prompt lookup matches (then how many of its proposals would be accepted). A step over T verified tokens
costs ``curve(T)``, plus the block's seconds when the draft's block ran, plus the head's seconds whenever the draft
was asked. The same draws decide every fixed strategy's steps, so the policy is compared with them on the same text.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass

import pytest
import torch

from dmtp_policy import (
    Calibration,
    ModeledCosts,
    RequestPolicy,
    StepCosts,
    allocate,
    best_uniform_width,
    choose_sources,
    expected_commits,
    prompt_lookup,
)
from dmtp_policy.ledger import Judged
from dmtp_policy.requests import DRAFT, LOOKUP

K = 4


def reference_lookup(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """vLLM's n-gram proposer, written plainly: the longest n-gram ending the tokens that occurs earlier, its
    earliest occurrence, the tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []


def test_prompt_lookup_finds_what_vllms_ngram_proposer_finds():
    rng = random.Random(0)
    for _ in range(50):
        rows = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))] for _ in range(5)]
        width = max(map(len, rows)) + 3
        padded = torch.tensor([r + [7] * (width - len(r)) for r in rows])  # padding must never match
        proposals, counts = prompt_lookup(padded, torch.tensor([len(r) for r in rows]), 5, min_ngram=2, max_ngram=3)
        for row, tokens in enumerate(rows):
            expected = reference_lookup(tokens, 5, 2, 3)
            assert proposals[row, : counts[row]].tolist() == expected, (tokens, proposals[row], counts[row])


def test_allocation_is_the_best_of_every_width_vector():
    rng = random.Random(1)
    for _ in range(30):
        batch, k = rng.randint(1, 3), rng.randint(1, 3)
        rates = torch.rand(batch, k, generator=torch.Generator().manual_seed(rng.randrange(1000)))
        gain = rates.cumprod(dim=1)
        gain[0, k - 1 :] = float("-inf") if rng.random() < 0.3 else gain[0, k - 1 :]  # a shorter proposal
        increments = [rng.uniform(0.01, 0.5) for _ in range(batch * (k + 1) + 1)]
        seconds = torch.tensor([1.0 + sum(increments[:t]) for t in range(batch * (k + 1) + 1)])
        plan = allocate(gain, seconds)
        best = 0.0
        for widths in itertools.product(range(k + 1), repeat=batch):
            tokens = sum(1 + float(gain[b, :w].sum()) for b, w in enumerate(widths))
            best = max(best, tokens / float(seconds[batch + sum(widths)]))
        assert plan.rate == pytest.approx(best, rel=1e-5)
        assert plan.tokens == pytest.approx(
            sum(float(expected_commits(rates[b : b + 1])[0, w]) for b, w in enumerate(plan.widths.tolist())), rel=1e-5
        ) or bool(torch.isinf(gain).any())


def test_a_dearer_step_verifies_fewer_proposals_and_a_flat_one_verifies_all():
    gain = torch.tensor([[0.9, 0.7, 0.5, 0.3], [0.6, 0.3, 0.1, 0.05]])
    flat = allocate(gain, torch.ones(11))
    assert flat.widths.tolist() == [4, 4]  # every proposal is free
    steep = allocate(gain, 1.0 + 0.2 * torch.arange(11.0))
    assert steep.verified < 8 and steep.widths[0] >= steep.widths[1]
    assert allocate(gain, 1.0 + 5.0 * torch.arange(11.0)).verified == 0  # a plain step


def test_uniform_width_and_source_choice():
    gain = torch.tensor([[0.9, 0.8, 0.7], [0.9, 0.8, 0.7]])
    assert best_uniform_width(gain, [1.0, 1.0, 1.0, 1.0]) == 3
    assert best_uniform_width(gain, [1.0, 2.0, 3.0, 4.0]) == 0
    draft = torch.tensor([[0.5, 0.2, 0.1], [0.5, 0.2, 0.1]])
    lookup = torch.tensor([[0.95, 0.9, 0.85], [0.3, float("-inf"), float("-inf")]])
    source = choose_sources(torch.stack([draft, lookup]), 1.0 + 0.1 * torch.arange(9.0))
    assert source.tolist() == [1, 0]  # the long likely match, else the draft


def test_step_costs_interpolate_never_decrease_and_follow_the_load():
    costs = StepCosts()
    costs.observe(2, 1.0)
    costs.observe(10, 3.0)
    curve = costs.curve(14)
    assert curve[2] == pytest.approx(1.0) and curve[10] == pytest.approx(3.0) and curve[6] == pytest.approx(2.0)
    assert curve[14] == pytest.approx(4.0)  # the last segment's slope
    assert bool((curve[1:] >= curve[:-1]).all())
    before = costs.seconds(10)
    for _ in range(20):
        costs.observe(2, 2.0)  # the machine got twice as slow: only T = 2 runs, T = 10 follows
    assert costs.seconds(10) > 1.5 * before


def test_modeled_costs_price_steps_and_stages_and_refuse_what_is_not_a_cost():
    """What ``DMTP_VLLM_MODELED_COSTS`` tells the policy in place of the clock (tests and simulations)."""
    costs = ModeledCosts.parse("fixed=0.02, per_token=0.0005,block=0.002")
    assert costs.step(4) == pytest.approx(0.022) and costs.step(32) == pytest.approx(0.036)
    assert costs.stage("block") == pytest.approx(0.002) and costs.stage("t1") == 0.0
    for bad in ["per_token=0.1", "fixed=0", "fixed=0.1,fixed=0.2", "fixed=0.1,head=1", "fixed=fast", "fixed=1,t1=-1"]:
        with pytest.raises(ValueError):
            ModeledCosts.parse(bad)


@dataclass
class World:
    """What each step's text allows and what a step costs."""

    draft_rates: list[float]
    lookup_share: float = 0.0  # requests whose prompt lookup matches
    lookup_rates: tuple[float, ...] = (0.9, 0.85, 0.8, 0.75)
    base: float = 1.0  # a plain step over the batch
    per_token: float = 0.1  # every verified token
    head: float = 0.05
    block: float = 0.15
    load: float = 1.0
    # seconds a step that drafted costs beyond what the engine reports to the policy (work outside the timed parts):
    # only the engine's whole cycle shows it
    unreported: float = 0.0

    def step_seconds(self, batch: int, verified: int, asked: bool, block: bool) -> float:
        extra = (self.head if asked else 0.0) + (self.block if block else 0.0) + (self.unreported if asked else 0.0)
        return self.load * (self.base + self.per_token * (batch + verified) + extra)


def draw(world: World, rng: random.Random, batch: int):
    """Per request: draft proposals accepted, the draft's confidences, lookup proposals, lookup proposals accepted."""
    rows = []
    for _ in range(batch):
        # the draft's confidence is what it is worth: proposal j is accepted with the probability it was given
        conf = [min(max(r + rng.uniform(-0.1, 0.1), 0.02), 0.98) for r in world.draft_rates]
        accepted = 0
        while accepted < K and rng.random() < conf[accepted]:
            accepted += 1
        lookup = rng.randint(2, K) if rng.random() < world.lookup_share else 0
        taken = 0
        while taken < lookup and rng.random() < world.lookup_rates[taken]:
            taken += 1
        rows.append((accepted, conf, lookup, taken))
    return rows


def policy_step(policy: RequestPolicy, world: World, rows, step: int) -> tuple[int, float]:
    """One engine step driven as the vLLM plugin drives it: (tokens committed, seconds)."""
    batch = len(rows)
    ids = [f"r{b}" for b in range(batch)]
    lookup_counts = torch.tensor([r[2] for r in rows])
    asked = policy.drafts(lookup_counts)
    block = False
    conf = None
    if asked:
        conf = torch.tensor([r[1] for r in rows])
        block = policy.wants_block(conf[:, 0], lookup_counts)
        conf = conf if block else conf[:, :1]
    plan = policy.choose(ids, conf, lookup_counts)
    accepted = torch.tensor(
        [min(r[3] if s == LOOKUP else r[0], int(w)) for r, s, w in zip(rows, plan.source.tolist(), plan.widths)]
    )
    committed = int((accepted + 1).sum())
    verified = int(plan.widths.sum())
    seconds = world.step_seconds(batch, verified, asked, block)
    # the next step's propose hears the verdict and the cost of this one; the text judges what was not verified
    policy.learn(ids, plan.widths, accepted)
    judged = []
    for b, r in enumerate(rows):
        if conf is not None:
            drafted = conf.shape[1]
            first = int(plan.verified_from(DRAFT)[b])
            judged.append(Judged(DRAFT, first, drafted, min(r[0], drafted), policy.padded_conf(conf[b : b + 1])[0]))
        if r[2]:
            judged.append(Judged(LOOKUP, int(plan.verified_from(LOOKUP)[b]), r[2], r[3], None))
    policy.learn_judged(judged)
    stages = {"t1": world.load * world.head if asked else 0.0, "block": world.load * world.block if block else 0.0}
    for stage, stage_seconds in stages.items():
        if stage_seconds:
            policy.stage_timed(stage, stage_seconds)
    reported = seconds - sum(stages.values()) - (world.load * world.unreported if asked else 0.0)
    policy.step_timed(ids, batch + verified, reported, committed, cycle_seconds=seconds)
    return committed, seconds


def fixed_step(world: World, rows, strategy: str, width: int = K) -> tuple[int, float]:
    """A fixed strategy on the same draws: ``plain``, ``draft`` (every request verifies ``width``) or ``lookup``
    (vLLM's n-gram: every match verified in full, the draft never runs)."""
    batch = len(rows)
    if strategy == "plain":
        return batch, world.step_seconds(batch, 0, False, False)
    if strategy == "lookup":
        return sum(1 + r[3] for r in rows), world.step_seconds(batch, sum(r[2] for r in rows), False, False)
    committed = sum(1 + min(r[0], width) for r in rows)
    return committed, world.step_seconds(batch, batch * width, width > 0, width > 1)


def race(world: World, batch: int, steps: int = 400, seed: int = 0, shift=None) -> dict[str, float]:
    """Tokens per second of the policy and of every fixed strategy on the same draws."""
    rng = random.Random(seed)
    policy = RequestPolicy(K, Calibration(), lookup=True)
    totals: dict[str, list[float]] = {}
    for step in range(steps):
        if shift is not None:
            shift(world, step)
        rows = draw(world, rng, batch)
        results = {"policy": policy_step(policy, world, rows, step), "plain": fixed_step(world, rows, "plain")}
        results["lookup"] = fixed_step(world, rows, "lookup")
        for width in range(1, K + 1):
            results[f"draft{width}"] = fixed_step(world, rows, "draft", width)
        for name, (tokens, seconds) in results.items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += tokens
            total[1] += seconds
    return {name: tokens / seconds for name, (tokens, seconds) in totals.items()}


def best_fixed(rates: dict[str, float]) -> float:
    return max(v for k, v in rates.items() if k.startswith("draft"))


WORLDS = {
    "good draft, cheap tokens": (World([0.9, 0.8, 0.8, 0.7], per_token=0.02), 1),
    "good draft, batch 8": (World([0.9, 0.8, 0.8, 0.7], per_token=0.05), 8),
    "weak draft": (World([0.2, 0.1, 0.1, 0.1]), 1),
    "weak draft, batch 8": (World([0.2, 0.1, 0.1, 0.1]), 8),
    "dear tokens (a CPU at 16 requests)": (World([0.7, 0.6, 0.5, 0.4], per_token=0.5), 16),
    "lookup matches often": (World([0.4, 0.3, 0.3, 0.2], lookup_share=0.7), 1),
    "lookup and draft, batch 4": (World([0.7, 0.6, 0.5, 0.4], lookup_share=0.4, per_token=0.05), 4),
}


@pytest.mark.parametrize("name", list(WORLDS))
def test_the_policy_is_never_slower_than_plain_lookup_or_the_best_fixed_width(name):
    """Over four seeds (as ``tests/test_width_guard.py`` judges ``generate``'s ``auto``): on average >= 0.97x the
    better of plain steps and prompt lookup alone and >= 0.95x the best fixed width, and never below 0.90x either.
    (One seed alone can miss where the draft's edge is a few percent: its tested proposals may be unluckier than
    the fixed strategies' full run.)"""
    world, batch = WORLDS[name]
    floors, fixed = [], []
    for seed in range(4):
        rates = race(World(**vars(world)), batch, seed=seed)
        floors.append(rates["policy"] / max(rates["plain"], rates["lookup"]))
        fixed.append(rates["policy"] / best_fixed(rates))
    assert statistics.mean(floors) >= 0.97 and min(floors) >= 0.90, (name, floors)
    assert statistics.mean(fixed) >= 0.95 and min(fixed) >= 0.90, (name, fixed)


def test_a_cost_curve_that_rises_with_batch_tokens_narrows_the_widths():
    narrow = RequestPolicy(K, Calibration())
    wide = RequestPolicy(K, Calibration())
    for policy, per_token, batch in ((wide, 0.01, 1), (narrow, 0.3, 16)):
        world = World([0.7, 0.6, 0.5, 0.4], per_token=per_token)
        rng = random.Random(0)
        for step in range(200):
            policy_step(policy, world, draw(world, rng, batch), step)
    mean_width = {p: p.counters.verified / p.counters.rows for p in (narrow, wide)}
    assert mean_width[wide] > 2.5 and mean_width[narrow] < 1.0, mean_width


def test_a_draft_that_stops_being_accepted_is_dropped_and_retried():
    def collapse(world: World, step: int) -> None:
        world.draft_rates = [0.9, 0.8, 0.8, 0.7] if step < 150 or step >= 450 else [0.02] * K

    rates = race(World([0.9, 0.8, 0.8, 0.7], per_token=0.05), 2, steps=600, shift=collapse)
    assert rates["policy"] >= 0.97 * rates["plain"] and rates["policy"] >= 0.95 * best_fixed(rates), rates


def test_load_changing_during_the_run_keeps_the_policy_ahead():
    def swing(world: World, step: int) -> None:
        world.load = 1.0 if (step // 50) % 2 == 0 else 3.0
        world.per_token = 0.05 if (step // 75) % 2 == 0 else 0.4

    rates = race(World([0.8, 0.7, 0.6, 0.5], lookup_share=0.3), 4, steps=600, shift=swing)
    assert rates["policy"] >= 0.97 * max(rates["plain"], rates["lookup"]), rates
    assert rates["policy"] >= 0.95 * best_fixed(rates), rates


def test_a_cost_only_the_clock_sees_stops_drafting():
    """Drafting costs more than the engine reports (the estimates and the guard see a win): the race of free windows
    against plain windows, by the engine's whole cycle, decodes plainly."""
    for batch in (1, 4):
        world = World([0.6, 0.5, 0.4, 0.3], per_token=0.05, unreported=1.0)
        rates = race(world, batch, steps=1000)
        assert rates["policy"] >= 0.95 * rates["plain"], (batch, rates)
        assert rates["plain"] > 1.1 * best_fixed(rates), rates  # the world is one where drafting loses


def test_prompt_lookup_rounds_are_taken_where_lookup_is_the_better_bet():
    policy = RequestPolicy(K, Calibration())
    world = World([0.3, 0.2, 0.2, 0.1], lookup_share=0.6)
    rng = random.Random(0)
    for step in range(300):
        policy_step(policy, world, draw(world, rng, 2), step)
    counters = policy.counters
    assert counters.lookup_rows > 0.3 * counters.rows, vars(counters)
    assert policy.lookup.prior[0] > 0.8  # it learned what lookup proposals commit
    assert DRAFT == 0 and LOOKUP == 1


def test_a_step_the_race_makes_plain_is_known_before_anything_is_drafted():
    """`plain_by_race` foretells `drafts`' race-forced plain steps (the vLLM plugin then defers the draft's state,
    `dmtp_vllm.stash`): exactly those steps, and they verify nothing."""
    world = World([0.6, 0.5, 0.4, 0.3], per_token=0.05, unreported=1.0)  # drafting loses: the race backs off
    policy, rng, foreseen = RequestPolicy(K, Calibration()), random.Random(0), 0
    for step in range(600):
        predicted = policy.plain_by_race(2)
        race_plain, plain = policy.counters.race_plain_steps, policy.counters.plain_steps
        policy_step(policy, world, draw(world, rng, 2), step)
        assert predicted == (policy.counters.race_plain_steps > race_plain), step
        assert not predicted or policy.counters.plain_steps > plain, step
        foreseen += predicted
    assert foreseen > 300, foreseen
