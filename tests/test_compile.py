"""A compiled verify forward (``compile=True`` / ``dmtp_compile``): the same tokens as eager, without graph breaks.

Dynamo's ``eager`` backend traces exactly what inductor would compile (graph breaks, guards, recompiles) at a fraction
of the cost; one slow-marked test runs inductor end to end.
"""

from __future__ import annotations

import pytest
import torch
from conftest import draft_for
from transformers import CompileConfig
from transformers.cache_utils import StaticCache

from dmtp_hf.assistant.generate import compiled_verify_config
from dmtp_hf.assistant.generate import generate as dmtp_generate

TRACE_ONLY = CompileConfig(backend="eager", fullgraph=False, dynamic=False)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])  # full attention (MLA) and hybrid GatedDeltaNet
def test_compiled_verify_is_lossless_and_traces_without_graph_breaks(targets, family):
    """Greedy output equals plain ``generate``; the verify forward traces as one graph (a graph break inside it,
    e.g. a hook calling something Dynamo cannot trace, re-enters Transformers' wrappers once per module class and
    exhausts the recompile limit, silently falling back to eager)."""
    from torch._dynamo.utils import counters

    target = targets[family]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=24)
    counters.clear()
    out = dmtp_generate(target, prompt, draft, do_sample=False, max_new_tokens=24, compile=TRACE_ONLY)
    assert torch.equal(out, reference)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile


def test_compiled_verify_through_target_generate_at_every_width(targets):
    """``target.generate(..., assistant_model=draft, dmtp_compile=...)``: fixed widths (one graph each, up to K + 1
    within the raised recompile limit) give the plain tokens; the cache becomes static."""
    target = targets["deepseek_v3"]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=16)
    for width in [2, 0]:
        out = target.generate(
            prompt,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=16,
            dmtp_compile=TRACE_ONLY,
            dmtp_verify_length=width,
        )
        assert torch.equal(out, reference), width


def test_compiled_verify_keeps_its_graphs_across_prompt_lengths(targets):
    """A second call with another prompt length compiles nothing new: the static cache's length (guarded on by every
    graph) is bucketed and never shrinks for a target, as Transformers' own ``generate`` keeps it."""
    from torch._dynamo.utils import counters

    target = targets["qwen3_5"]
    draft = draft_for(target)
    counters.clear()
    for length in (6, 4, 9):
        prompt = torch.arange(5, 5 + length)[None]
        reference = target.generate(prompt, do_sample=False, max_new_tokens=12)
        out = dmtp_generate(target, prompt, draft, do_sample=False, max_new_tokens=12, compile=TRACE_ONLY)
        assert torch.equal(out, reference), length
        if length == 6:
            graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs


def test_compile_settings_and_refusals(targets):
    """``True`` picks the generation config's ``compile_config`` or a default per device; a growing cache and a
    batch are refused with a reason."""
    target = targets["deepseek_v3"]
    assert compiled_verify_config(target, False) is None
    default = compiled_verify_config(target, True)
    assert default.mode == "default" and default.dynamic is False  # CPU: no CUDA graphs
    mine = CompileConfig(backend="eager")
    assert compiled_verify_config(target, mine) is mine
    assert compiled_verify_config(target, True, type("G", (), {"compile_config": mine})()) is mine

    from transformers.cache_utils import DynamicCache

    from dmtp_hf.assistant.decoding import target_cache

    # a compiled verify needs fixed shapes: an empty growing cache is replaced, one holding a conversation refused
    assert isinstance(target_cache(target, DynamicCache(config=target.config), 1, 32, 7, TRACE_ONLY), StaticCache)
    held = DynamicCache(config=target.config)
    target(input_ids=torch.tensor([[5, 17, 42, 9]]), cache=held, use_cache=True)
    with pytest.raises(ValueError, match="needs a static cache"):
        target_cache(target, held, 1, 32, 7, TRACE_ONLY)
    assert isinstance(target_cache(target, None, 1, 32, 7, TRACE_ONLY), StaticCache)
    draft = draft_for(target)
    batch = torch.tensor([[5, 17, 42, 9], [1, 5, 17, 42]])
    with pytest.raises(NotImplementedError, match="batch size 1"):
        dmtp_generate(target, batch, draft, do_sample=False, max_new_tokens=4, compile=TRACE_ONLY)


@pytest.mark.slow
def test_inductor_compiled_verify_is_lossless(targets):
    """Inductor end to end (minutes on CPU): generated code, not just the trace, gives the plain tokens."""
    target = targets["qwen3_5"]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42, 9]])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out = dmtp_generate(target, prompt, draft, do_sample=False, max_new_tokens=24, compile=True)
    assert torch.equal(out, reference)
