"""The fast path (``fixed_shapes=True``, assistant/drafter_state.py): the same proposals as the default
drafters, round by round, for every family and strategy, batched with ragged acceptance and left padding, greedy
and sampled; CUDA-graph replay equals eager where a GPU exists."""

import pytest
import torch
from conftest import draft_for
from test_engine import OracleMix, greedy_reference

from dmtp_hf.assistant import speculative_decode
from dmtp_hf.assistant.drafters.base import DrafterWrapper
from dmtp_hf.assistant.drafters.cuda_graphs import CUDAGraphCall
from dmtp_hf.assistant.drafters.dflash import DFlashDrafter
from dmtp_hf.assistant.drafters.dmtp import DMTPDrafter
from dmtp_hf.assistant.drafters.mtp import MTPDrafter
from dmtp_hf.assistant.drafters.state import FAR, SlotKV
from dmtp_hf_assets.tiny_targets import FAMILIES

MAX_NEW = 24


class Recorder(DrafterWrapper):
    """Records every proposal (tokens per round)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.proposals = []

    def propose(self, anchor_ids, anchor_positions, select, stats):
        proposal = self.inner.propose(anchor_ids, anchor_positions, select, stats)
        self.proposals.append(proposal.tokens.clone())
        return proposal


def pairs(target):
    """(dynamic, fast) drafters of every strategy over the same weights."""
    dual = draft_for(target)
    dflash = draft_for(target, anchor_layout="dflash")
    return {
        "dmtp": (DMTPDrafter(dual, dual.native_mtp), DMTPDrafter(dual, dual.native_mtp, fixed_shapes=True)),
        "dflash": (DFlashDrafter(dflash), DFlashDrafter(dflash, fixed_shapes=True)),
        "mtp1": (MTPDrafter(dual.native_mtp, 1), MTPDrafter(dual.native_mtp, 1, fixed_shapes=True)),
        "mtp4": (MTPDrafter(dual.native_mtp, 4), MTPDrafter(dual.native_mtp, 4, fixed_shapes=True)),
    }


def _run(target, prompt, drafter, reference, seed, **kwargs):
    recorder = Recorder(OracleMix(drafter, reference, seed=seed))
    out, stats = speculative_decode(target, prompt, recorder, max_length=reference.shape[1], **kwargs)
    return out, stats, recorder.proposals


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_proposes_exactly_what_the_dynamic_path_does(targets, family):
    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = greedy_reference(target, prompt)
    for name, (dynamic, fast) in pairs(target).items():
        out_d, stats_d, proposals_d = _run(target, prompt, dynamic, reference, seed=7)
        out_f, stats_f, proposals_f = _run(target, prompt, fast, reference, seed=7)
        assert torch.equal(out_f, reference), f"{family}/{name}"
        assert len(proposals_f) == len(proposals_d) > 2
        for round_index, (a, b) in enumerate(zip(proposals_d, proposals_f)):
            assert torch.equal(a, b), f"{family}/{name} round {round_index}: {a.tolist()} vs {b.tolist()}"
        assert stats_f.hist == stats_d.hist and sum(1 for c in stats_f.hist if c) >= 2


def test_fast_path_batched_ragged_rows_with_left_padding(targets):
    target = targets["qwen3_5"]
    pad = 0
    rows = [[5, 17, 42, 9, 77, 3, 64], [11, 12], [90, 3, 14, 15, 92]]
    width = max(map(len, rows))
    prompt = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    references = [greedy_reference(target, torch.tensor([r]), max_new_tokens=MAX_NEW)[0, len(r) :] for r in rows]
    for name, (dynamic, fast) in pairs(target).items():
        outs, proposals = [], []
        for drafter in (dynamic, fast):
            recorder = Recorder(drafter)
            out, _ = speculative_decode(
                target, prompt, recorder, max_length=width + MAX_NEW, attention_mask=mask, pad_token_id=pad
            )
            outs.append(out)
            proposals.append(recorder.proposals)
        assert torch.equal(outs[0], outs[1]), name
        for b, reference in enumerate(references):
            assert torch.equal(outs[1][b, width:], reference), f"{name} row {b}"
        assert all(torch.equal(a, b) for a, b in zip(*proposals)) and len(proposals[0]) == len(proposals[1])


def test_fast_path_sampling_draws_the_same_tokens(targets):
    target = targets["deepseek_v3"]
    prompt = torch.tensor([[5, 17, 42, 9]])
    for name, (dynamic, fast) in pairs(target).items():
        outs = []
        for drafter in (dynamic, fast):
            torch.manual_seed(123)
            out, _ = speculative_decode(
                target, prompt, drafter, max_length=4 + MAX_NEW, do_sample=True, verify_mode="rejection"
            )
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), name


def test_fast_path_through_target_generate(targets):
    target = targets["qwen3_5"]
    prompt = torch.tensor([[5, 17, 42, 9, 77]])
    reference = greedy_reference(target, prompt)
    draft = draft_for(target)
    out = target.generate(prompt, assistant_model=draft, dmtp_fast_path=True, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(out, reference)


def test_slot_cache_writes_compacted_rows_and_scratch_is_invisible():
    cache = SlotKV(fixed_shapes=True)
    cache.limit = 6
    cache.reset(2, torch.device("cpu"))
    valid = torch.tensor([[False, True, True], [True, False, False]])
    positions = torch.tensor([[0, 0, 1], [0, 1, 2]])
    assert cache.begin([2, 1], 3) == 2  # the span: the longest row, not the capacity
    cache.prepare(valid, positions)
    key = torch.arange(2 * 3, dtype=torch.float).view(2, 1, 3, 1)
    keys, _ = cache.update(key, key, 0)
    assert cache.lengths.tolist() == [2, 1] and keys.shape[2] == 2
    # row 0: its two valid slots land at 0 and 1; row 1: one slot at 0; invalid slots go to the scratch column 6
    assert keys[0, 0, :2, 0].tolist() == [1.0, 2.0] and keys[1, 0, 0, 0].item() == 3.0
    assert cache.key_valid().tolist() == [[True, True], [True, False]]
    assert cache.positions[:, cache.capacity].tolist() == [FAR, FAR]
    saved = cache.save()
    cache.begin(None, 1)
    cache.prepare(torch.ones(2, 1, dtype=torch.bool), torch.tensor([[2], [1]]))
    cache.update(key[:, :, :1], key[:, :, :1], 0)
    assert cache.lengths.tolist() == [3, 2] and cache.span == 4  # fixed shapes: spans are powers of two
    cache.restore(saved)  # rollback is just the lengths
    assert cache.key_valid().sum(-1).tolist() == [2, 1]


def test_slots_grow_without_fixed_shapes_and_attention_spans_only_the_filled_prefix():
    cache = SlotKV()
    cache.reset(1, torch.device("cpu"))
    total = 0
    for width in (300, 8, 200):  # past the initial capacity twice
        cache.begin(None, width)
        cache.prepare(torch.ones(1, width, dtype=torch.bool), torch.arange(total, total + width)[None])
        keys, _ = cache.update(torch.ones(1, 1, width, 2) * width, torch.zeros(1, 1, width, 2), 0)
        total += width
        assert keys.shape[2] == total and cache.key_valid() is None  # exact span, every slot real
    assert cache.capacity >= total and keys[0, 0, :300, 0].eq(300).all() and keys[0, 0, 308:, 0].eq(200).all()
    assert cache.key_positions()[0].tolist() == list(range(total))


def test_graph_call_runs_eagerly_without_cuda():
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    call = CUDAGraphCall(fn, lambda: [])
    assert torch.equal(call(torch.ones(3)), torch.full((3,), 2.0)) and calls == [1] and call.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (scripts/gpu_check.py runs this)")
def test_cuda_graph_replay_matches_eager(targets):
    target = targets["qwen3_5"].cuda()
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]], device="cuda")
    reference = greedy_reference(target, prompt)
    dual = draft_for(target).cuda()
    eager = DMTPDrafter(dual, dual.native_mtp, fixed_shapes=True, cuda_graphs=False)
    graphed = DMTPDrafter(dual, dual.native_mtp, fixed_shapes=True, cuda_graphs=True)
    out_e, _, proposals_e = _run(target, prompt, eager, reference, seed=2)
    out_g, _, proposals_g = _run(target, prompt, graphed, reference, seed=2)
    assert torch.equal(out_g, reference) and torch.equal(out_e, out_g)
    assert all(torch.equal(a, b) for a, b in zip(proposals_e, proposals_g))
    assert graphed.mtp._advance.replays > 0 and graphed.context._forward.replays > 0


def test_gpu_check_script_dry_run_on_cpu(tmp_path, capsys):
    """The GPU check's CPU dry run on the bundled models: every section runs and lands in the JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    output = tmp_path / "check.json"
    argv = ["--device", "cpu", "--targets", "bundled", "--prompts", "2", "--max-new-tokens", "12"]
    assert module.main([*argv, "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    bundled = report["targets"]["bundled"]
    assert all(
        r["graph_equals_eager"] == r["prompts"] == 2 and r["ok"]
        for n, r in bundled["correctness"].items()
        if n != "fallback_warnings"
    )
    stages = bundled["stages_ms_per_round"]
    assert {"dmtp (fast)", "dmtp (dynamic, eager)", "dflash (fast)", "mtp1 (fast)"} <= set(stages)
    for row in stages.values():  # synchronised stage times add up to the round (CPU: no graph to sync)
        assert 0.8 * row["round"] <= row["stage_sum"] <= row["round"] * 1.001
    assert bundled["tokens_per_second"]["generate"] > 0
    assert "[PASS] dmtp" in capsys.readouterr().out


def test_a_failed_graph_capture_warns_once_runs_eagerly_and_is_counted(monkeypatch):
    from types import SimpleNamespace

    from dmtp_hf.assistant.stats import SpecStats

    calls = []
    call = CUDAGraphCall(lambda x: calls.append(x) or "eager", lambda: [])
    cuda_like = SimpleNamespace(is_cuda=True, shape=(2,), dtype=torch.float32)  # what __call__ reads of its inputs

    def refuse(inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(call, "_capture", refuse)
    with pytest.warns(RuntimeWarning, match="capture failed.*not permitted"):
        assert call(cuda_like) == "eager"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the stage now stays eager
        assert call(cuda_like) == "eager"
    assert len(calls) == 2 and call.failure and call.replays == 0
    stats = SpecStats(7)
    stats.record_graphs([call])
    assert stats.to_dict()["cuda_graphs"] == {"captures": 0, "replays": 0, "failures": [call.failure]}
    assert SpecStats.from_dict(stats.to_dict()).cuda_graphs["failures"] == [call.failure]
