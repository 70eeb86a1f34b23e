"""DMTP in vLLM on this CPU: lossless under vLLM's scheduler, the same proposals as dmtp-hf's engine, refusals by name.

SmolLM2-135M-Instruct (fp32) with the bundled drafts; 16 prompts whose budgets differ, so requests of a batch finish
at different steps (continuous batching) and the padded drafter batch carries rejected slots. At temperature 1 the
sampled tokens follow the target's distribution (vLLM's rejection sampler verifies the greedy draft, q one-hot).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch
from conftest import close, make_engine

GREEDY = dict(temperature=0.0)
SAMPLED_RUNS = 320  # requests per engine at temperature 1
# what the adaptive policy is told a step and the drafter's stages cost (dmtp_policy.ModeledCosts)
MODELED_COSTS = "fixed=0.02,per_token=0.0002,t1=0.001,block=0.002"
SAMPLED_TOKENS = 3  # the first comes from the prefill, the next two from verified rounds


def generate(engine, prompts: list[dict]) -> list[list[int]]:
    """Greedy token ids of ``prompts`` submitted together (vLLM batches them, up to ``max_num_seqs``)."""
    from vllm import SamplingParams, TokensPrompt

    outputs = engine.generate(
        [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in prompts],
        [SamplingParams(max_tokens=p["max_tokens"], **GREEDY) for p in prompts],
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_counters(engine) -> dict[str, object]:
    """Cumulative speculative-decoding counters of an engine: drafts (rounds), accepted tokens, per position."""
    metrics = {m.name: m for m in engine.get_metrics()}
    return {
        "drafts": metrics["vllm:spec_decode_num_drafts"].value,
        "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value,
        "per_pos": list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    }


def sample(engine, prompt_token_ids: list[int], first_seed: int) -> list[tuple[int, ...]]:
    """``SAMPLED_RUNS`` continuations of one prompt at temperature 1, request ``i`` seeded ``first_seed + i``."""
    from vllm import SamplingParams, TokensPrompt

    outputs = engine.generate(
        [TokensPrompt(prompt_token_ids=prompt_token_ids)] * SAMPLED_RUNS,
        [SamplingParams(max_tokens=SAMPLED_TOKENS, temperature=1.0, seed=first_seed + i) for i in range(SAMPLED_RUNS)],
        use_tqdm=False,
    )
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def two_sample_chi_square(first: list, second: list, min_count: int = 10) -> float:
    """p-value that two equally large samples come from one distribution (categories seen fewer than
    ``min_count`` times in both together pooled into one)."""
    assert len(first) == len(second)
    a, b = collections.Counter(first), collections.Counter(second)
    kept = [x for x in a.keys() | b.keys() if a[x] + b[x] >= min_count]
    observed = torch.tensor([[a[x], b[x]] for x in kept] + [[len(first), len(second)]], dtype=torch.float64)
    observed[-1] -= observed[:-1].sum(0)  # the pooled rest
    observed = observed[observed.sum(1) > 0]
    statistic = ((observed[:, 0] - observed[:, 1]) ** 2 / observed.sum(1)).sum()
    degrees = torch.tensor(observed.shape[0] - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees / 2, statistic / 2))


@pytest.fixture(scope="module")
def sampled_prompt(target) -> list[int]:
    """A chat prompt whose first tokens have a few likely continuations (a test with power at a few hundred runs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    messages = [{"role": "user", "content": "Name a primary color."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def plain(target, prompts, sampled_prompt) -> dict[str, list]:
    """vLLM's plain output (no drafter): greedy for every prompt, and the temperature-1 sample."""
    engine = make_engine(target, None)
    try:
        return {"greedy": generate(engine, prompts), "sampled": sample(engine, sampled_prompt, first_seed=0)}
    finally:
        close(engine)


@pytest.fixture(scope="module")
def plain_tokens(plain) -> list[list[int]]:
    """vLLM's plain greedy output for every prompt."""
    return plain["greedy"]


@pytest.fixture(scope="module")
def dmtp_engine(target, exported, plain_tokens):
    """An engine speculating with the DMTP draft, up to 16 requests per step, under the plugin's default policy
    (adaptive widths per request, prompt lookup competing). Made after the plain engine has run (``plain_tokens``):
    creating an engine resets the process's metric registry, counters included."""
    engine = make_engine(target, {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7})
    yield engine
    close(engine)


def test_greedy_dmtp_is_token_identical_to_plain_vllm_at_batch_1_4_16(dmtp_engine, prompts, plain_tokens):
    """vLLM's own plain greedy decoding is the reference: every request, every batch size, whatever widths and
    sources the adaptive policy chose for each request and step (it chose some of each)."""
    for start in (0, 7):  # batch 1: one request at a time
        assert generate(dmtp_engine, prompts[start : start + 1]) == plain_tokens[start : start + 1]
    assert generate(dmtp_engine, prompts[2:6]) == plain_tokens[2:6]  # batch 4
    before = spec_counters(dmtp_engine)
    assert generate(dmtp_engine, prompts) == plain_tokens  # batch 16 (prefixes now cached)
    after = spec_counters(dmtp_engine)
    assert after["drafts"] > before["drafts"] and after["accepted"] > before["accepted"]
    report = dmtp_engine.collective_rpc("dmtp_policy_report")[0]
    widths = report["counters"]["widths"]
    assert len([w for w, rows in widths.items() if rows]) >= 3, widths  # widths differ between requests and steps
    assert report["counters"]["lookup_rows"] > 0 and report["counters"]["blocks"] > 0, report["counters"]


def test_every_proposal_verified_when_asked(target, exported, prompts, plain_tokens):
    """``verify: "all"`` (DMTP_VLLM_VERIFY=all) is vLLM's DFlash round with T1: every request verifies all K
    proposals every step, lossless, and the engine runs no policy."""
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    engine = make_engine(target, spec, max_num_seqs=4, verify="all")
    try:
        assert generate(engine, prompts[2:6]) == plain_tokens[2:6]
        assert engine.collective_rpc("dmtp_policy_report") == [None]
    finally:
        close(engine)


def by_position(log: list[tuple[str, int, list[int]]]) -> dict[tuple[int, int], list[int]]:
    """Drafted rows keyed by (the request's rank in order of first appearance, position): two engines given the
    same prompts in the same order key the same request alike."""
    rank: dict[str, int] = {}
    return {(rank.setdefault(request, len(rank)), position): row for request, position, row in log}


def test_lean_plain_steps_leave_the_proposals_as_they_were(target, exported, prompts, plain_tokens):
    """Plain steps that defer the draft's state to one catch-up pass when drafting resumes (``dmtp_vllm.stash``): at
    the positions both engines drafted, the same T1 and the same block as an engine that kept the state every step
    (requests joining and leaving during plain windows, four at a time). Rows cut from the catch-up would leave the
    head and the block attending to positions never written."""
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    logs = {}
    for name, lean in (("every step", None), ("lean", "3/6")):
        environ = {"DMTP_VLLM_PROPOSAL_LOG": "1", "DMTP_VLLM_LEAN_STEPS": lean}
        engine = make_engine(target, spec, max_num_seqs=4, verify="all", environ=environ)
        try:
            assert generate(engine, prompts) == plain_tokens
            logs[name] = by_position(engine.collective_rpc("dmtp_proposal_log")[0])
        finally:
            close(engine)
    full, lean = logs["every step"], logs["lean"]
    common = sorted(full.keys() & lean.keys())
    assert len(common) >= 100, (len(full), len(lean), len(common))
    same_t1 = sum(full[k][0] == lean[k][0] for k in common) / len(common)
    same_rows = sum(full[k] == lean[k] for k in common) / len(common)
    assert same_t1 >= 0.97 and same_rows >= 0.9, (same_t1, same_rows, len(common))


def test_installing_the_plugin_costs_plain_vllm_nothing(target):
    """vLLM plain decoding with dmtp-vllm installed against the same engine with ``VLLM_PLUGINS=none``, both alive,
    interleaved (bench/plugin_overhead.py): the median ratio of their times per job stays at 1. The bound here is
    loose (0.90) because a shared two-core machine swings by 10 % between jobs; the report measures the goal
    (>= 0.98) over more jobs. It catches what it was written for: installing the plugin once halved plain decoding.

    A first sample below the bound is not yet a verdict: on a busy CI machine one sample of 8 jobs has read 0.86
    where the same commit read 1.005 on an idle one. A second, larger sample is taken and the bound applies to the
    median of all jobs together, which a real cost (a slowdown in every job) still fails."""
    import statistics
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from plugin_overhead import chat_prompts, measure

    prompts, cores = chat_prompts(str(target), 4, 32), set(range(os.cpu_count()))
    results = [measure(str(target), prompts, rounds=2, cores=cores)]
    if results[0]["ratio"]["median"] < 0.90:
        results.append(measure(str(target), prompts, rounds=4, cores=cores))
    assert all(r["identical"] for r in results)
    ratios = [n / p for r in results for p, n in zip(r["seconds"]["plugin"], r["seconds"]["none"], strict=True)]
    assert statistics.median(ratios) >= 0.90, [r["ratio"] | {"jobs": r["jobs"]} for r in results]


def assert_same_distribution(plain_samples: list, speculative: list) -> None:
    """Tokens 2 and 3 of each continuation, and the pair, have one distribution in both samples."""
    for name, part in [("token 2", lambda s: s[1:2]), ("token 3", lambda s: s[2:3]), ("tokens 2-3", lambda s: s[1:])]:
        p_value = two_sample_chi_square([part(s) for s in plain_samples], [part(s) for s in speculative])
        assert p_value > 1e-3, f"{name}: DMTP's samples differ from plain vLLM's (chi-square p = {p_value:.2e})"


def test_sampling_at_temperature_1_keeps_the_target_distribution(target, exported, plain, sampled_prompt):
    """Every proposal verified (the DMTP round's T1 and block at full width): tokens 2 and 3 of each continuation
    come from verified rounds, and their distribution (and the pair's) is the plain engine's. Independent seeds in the
    two engines; drafts must have been accepted, or nothing was tested."""
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    engine = make_engine(target, spec, verify="all")
    try:
        speculative = sample(engine, sampled_prompt, first_seed=SAMPLED_RUNS)
        counters = spec_counters(engine)
    finally:
        close(engine)
    assert counters["accepted"] >= SAMPLED_RUNS // 4, counters
    assert_same_distribution(plain["sampled"], speculative)


def test_sampling_keeps_the_distribution_under_the_adaptive_policy(target, exported, plain, sampled_prompt):
    """The adaptive policy at four requests per step: requests of one step verify different numbers of proposals,
    from the draft or from prompt lookup, and vLLM's rejection sampler (with the plugin's expand kernel) must keep
    the target's distribution through every mix. The policy is told modeled costs (a step of T tokens 20 ms + 0.2 ms
    per token, a GPU-like curve) instead of the clock: what it verifies then follows from what is accepted alone, the
    same on every run (here 494 proposals verified, 83 accepted, widths 1 to 6), where by the clock a busy machine
    made its race back off to plain steps and left too little verified to test (26 proposals, 7 accepted)."""
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    environ = {"DMTP_VLLM_MODELED_COSTS": MODELED_COSTS}
    engine = make_engine(target, spec, max_num_seqs=4, verify="adaptive", environ=environ)
    try:
        speculative = sample(engine, sampled_prompt, first_seed=2 * SAMPLED_RUNS)
        counters = spec_counters(engine)
        widths = engine.collective_rpc("dmtp_policy_report")[0]["counters"]["widths"]
    finally:
        close(engine)
    assert counters["accepted"] >= SAMPLED_RUNS // 8, counters
    assert len([w for w, rows in widths.items() if int(w) > 0 and rows]) >= 3, widths
    assert_same_distribution(plain["sampled"], speculative)


def test_the_cpu_expand_kernel_writes_float_values():
    """The rejection sampler's per-token temperatures: vLLM's CPU stand-in leaves float outputs unwritten
    (dmtp_vllm.hook); the replacement expands every dtype, with the greedy marker replaced."""
    from dmtp_vllm.hook import expand_batch_values

    out = torch.full((6,), -5.0)
    expand_batch_values(out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 3, 6], dtype=torch.int32), 0.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])
    ints = torch.zeros(4, dtype=torch.int32)
    expand_batch_values(ints, torch.tensor([5, 9], dtype=torch.int32), torch.tensor([1, 4]), 0, 0)
    assert ints.tolist() == [5, 9, 9, 9]


def test_the_same_draft_accepts_as_in_dmtp_hf(target, exported, prompts, hf_reference):
    """One request at a time, as dmtp-hf decodes, compiled as vLLM runs by default: tau per verify within 2 % of
    dmtp-hf's own engine, and the first-candidate (T1) acceptance too; the text is the same wherever the two fp32
    targets agree."""
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    # every proposal verified, as dmtp-hf's engine does with all K; vLLM's default: the block model compiled
    engine = make_engine(target, spec, max_num_seqs=1, eager=False, verify="all")
    try:
        outputs = [generate(engine, [p])[0] for p in prompts]
        counters = spec_counters(engine)
    finally:
        close(engine)
    same = sum(out == ref["tokens"] for out, ref in zip(outputs, hf_reference, strict=True))
    assert same >= len(prompts) - 2, f"only {same} of {len(prompts)} outputs equal dmtp-hf's"
    hf_rounds = sum(r["rounds"] for r in hf_reference)
    hf_accepted = [sum(r["accepted_per_pos"][i] for r in hf_reference) for i in range(7)]
    vllm_tau = 1 + counters["accepted"] / counters["drafts"]
    hf_tau = 1 + sum(hf_accepted) / hf_rounds
    assert vllm_tau == pytest.approx(hf_tau, rel=0.02), (vllm_tau, hf_tau, counters, hf_accepted, hf_rounds)
    first_vllm, first_hf = counters["per_pos"][0] / counters["drafts"], hf_accepted[0] / hf_rounds
    assert first_vllm == pytest.approx(first_hf, abs=0.02), (first_vllm, first_hf)


def test_an_unsupported_vllm_version_is_refused_by_name():
    """The runner hook is pinned: another vLLM version is refused with the supported range in the message."""
    from dmtp_vllm.hook import UnsupportedVLLMVersion, check_version

    check_version("0.32.0")
    with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM 0.32.x; this is vLLM 0.33.1"):
        check_version("0.33.1")
