"""DMTP in vLLM on this CPU: lossless under vLLM's scheduler, the same proposals as dmtp-hf's engine, refusals by name.

SmolLM2-135M-Instruct (fp32) with the bundled drafts; 16 prompts whose budgets differ, so requests of a batch finish
at different steps (continuous batching) and the padded drafter batch carries rejected slots.
"""

from __future__ import annotations

import pytest
from conftest import close, make_engine

GREEDY = dict(temperature=0.0)


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


@pytest.fixture(scope="module")
def plain_tokens(target, prompts) -> list[list[int]]:
    """vLLM's plain greedy output for every prompt (no drafter)."""
    engine = make_engine(target, None)
    try:
        return generate(engine, prompts)
    finally:
        close(engine)


@pytest.fixture(scope="module")
def dmtp_engine(target, exported, plain_tokens):
    """An engine speculating with the DMTP draft, up to 16 requests per step. Made after the plain engine has run
    (``plain_tokens``): creating an engine resets the process's metric registry, counters included."""
    engine = make_engine(target, {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7})
    yield engine
    close(engine)


def test_greedy_dmtp_is_token_identical_to_plain_vllm_at_batch_1_4_16(dmtp_engine, prompts, plain_tokens):
    """vLLM's own plain greedy decoding is the reference: every request, every batch size."""
    for start in (0, 7):  # batch 1: one request at a time
        assert generate(dmtp_engine, prompts[start : start + 1]) == plain_tokens[start : start + 1]
    assert generate(dmtp_engine, prompts[2:6]) == plain_tokens[2:6]  # batch 4
    before = spec_counters(dmtp_engine)
    assert generate(dmtp_engine, prompts) == plain_tokens  # batch 16 (prefixes now cached)
    after = spec_counters(dmtp_engine)
    assert after["drafts"] > before["drafts"] and after["accepted"] > before["accepted"]


def test_the_same_draft_accepts_as_in_dmtp_hf(target, exported, prompts, hf_reference):
    """One request at a time, as dmtp-hf decodes, compiled as vLLM runs by default: tau per verify within 2 % of
    dmtp-hf's own engine, and the first-candidate (T1) acceptance too; the text is the same wherever the two fp32
    targets agree."""
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    engine = make_engine(target, spec, max_num_seqs=1, eager=False)  # vLLM's default: the block model compiled
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
