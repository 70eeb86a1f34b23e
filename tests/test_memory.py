"""Memory follows the tokens generated, not ``max_new_tokens``: a call that stops at EOS after a few tokens allocates
the same whatever its budget (up to budgets only Python's integers hold), with and without scores and logits."""

import pytest
import torch
from conftest import draft_for
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Allocations(TorchDispatchMode):
    """Counts the bytes of every tensor storage an op creates while active (views and in-place results excluded):
    the largest one and the sum. Tensor memory on CPU is invisible to tracemalloc; this sees every allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in inputs and not tensor._is_view():
                size = tensor.untyped_storage().nbytes()
                self.largest, self.total = max(self.largest, size), self.total + size
        return out


def measure(target, draft, prompt, **kwargs):
    """``(output, allocations)`` of one speculative call."""
    with Allocations() as allocations:
        out = target.generate(prompt, assistant_model=draft, do_sample=False, **kwargs)
    return out, allocations


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
@pytest.mark.parametrize("outputs", [{}, {"output_scores": True, "output_logits": True}])
def test_a_call_that_stops_early_allocates_the_same_whatever_its_budget(targets, family, outputs):
    target = targets[family]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=12)
    eos = int(reference[0, prompt.shape[1] + 5])  # the sixth generated token ends the call
    options = dict(eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, **outputs)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=1_000, **options)
    runs = {budget: measure(target, draft, prompt, max_new_tokens=budget, **options) for budget in (1_000, 50_000_000)}
    for out, _ in runs.values():
        assert torch.equal(out.sequences, expected.sequences)
        for name in ("scores", "logits") if outputs else ():
            assert len(getattr(out, name)) == expected.sequences.shape[1] - prompt.shape[1]
    small, large = runs[1_000][1], runs[50_000_000][1]
    assert (large.largest, large.total) == (small.largest, small.total)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("budget", [2**62, 2**63 - 1, 2**63, 10**19, 2**64, 10**30])
def test_a_budget_beyond_a_long_tensor_decodes_as_plain_generate(targets, family, budget):
    """``max_new_tokens`` up to and past what int64 holds (``2**63`` and beyond, which a long tensor cannot take)
    stops at EOS as plain ``generate`` does: every comparison with the budget uses the engine's clamped one."""
    target = targets[family]
    draft = draft_for(target)
    prompt = torch.tensor([[7, 8, 9, 10]])
    eos = int(target.generate(prompt, do_sample=False, max_new_tokens=8)[0, prompt.shape[1] + 3])
    options = dict(do_sample=False, max_new_tokens=budget, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(target.generate(prompt, assistant_model=draft, **options), target.generate(prompt, **options))


def test_a_long_generation_grows_its_buffers_and_stays_lossless(targets):
    """More tokens than the buffers first hold (256 columns): scores and tokens as plain ``generate`` gives them."""
    target = targets["deepseek_v3"]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42]])
    options = dict(do_sample=False, max_new_tokens=300, return_dict_in_generate=True, output_scores=True)
    plain = target.generate(prompt, **options)
    ours = target.generate(prompt, assistant_model=draft, **options)
    assert torch.equal(ours.sequences, plain.sequences) and len(ours.scores) == len(plain.scores) == 300
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(plain.scores), rtol=1e-4, atol=1e-4)


def test_an_all_padding_row_is_refused_by_name(targets):
    target = targets["deepseek_v3"]
    draft = draft_for(target)
    prompt = torch.tensor([[5, 17, 42], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"Row\(s\) \[1\] of attention_mask are all zeros"):
        target.generate(prompt, attention_mask=mask, assistant_model=draft, max_new_tokens=4, pad_token_id=0)


@pytest.mark.parametrize("budget", [2**62, 10**19, 10**30])
def test_the_fast_path_refuses_a_budget_it_would_have_to_allocate(targets, budget):
    """The fast path reserves its draft state for the whole call: a budget meant as "until EOS" is refused by name
    (not an overflow, not an allocation of that size); a budget it can hold still decodes as plain ``generate``."""
    target = targets["deepseek_v3"]
    draft = draft_for(target)
    prompt = torch.tensor([[7, 8, 9, 10]])
    with pytest.raises(ValueError, match="fast path"):
        target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=budget, dmtp_fast_path=True)
    options = dict(do_sample=False, max_new_tokens=12)
    fast = target.generate(prompt, assistant_model=draft, dmtp_fast_path=True, **options)
    assert torch.equal(fast, target.generate(prompt, **options))
