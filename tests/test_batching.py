"""Batched speculative decoding: B > 1 rows with mixed prompt lengths and ragged acceptance are each identical to
``target.generate`` on that row alone, for a dense and a hybrid (GatedDeltaNet) target."""

import random

import pytest
import torch
from conftest import draft_for

from dmtp_hf.assistant import DFlashDrafter, DMTPDrafter, Drafter, MTPDrafter, Proposal, SpecStats, speculative_decode
from dmtp_hf.assistant.drafters.base import DrafterWrapper

MAX_NEW = 16


class BatchOracle(DrafterWrapper):
    """Overwrites a random-length prefix of each row's candidates with that row's true greedy continuation, so
    rows accept different numbers of candidates in the same round (ragged acceptance)."""

    def __init__(self, inner: Drafter, references: list[torch.Tensor], seed: int = 0):
        super().__init__(inner)
        self.rng = random.Random(seed)
        longest = max(r.shape[0] for r in references)
        self.reference = torch.full((len(references), longest + 16), -1, dtype=torch.long)
        for row, ref in enumerate(references):
            self.reference[row, : ref.shape[0]] = ref

    def select_rows(self, rows, rows_host):
        self.reference = self.reference[rows]
        return self.inner.select_rows(rows, rows_host)

    def propose(self, anchor_ids, anchor_positions, select, stats):
        proposal = self.inner.propose(anchor_ids, anchor_positions, select, stats)
        batch, k = proposal.tokens.shape
        lengths = torch.tensor([self.rng.randint(0, k) for _ in range(batch)])
        index = (anchor_positions[:, None] + 1 + torch.arange(k)).clamp(max=self.reference.shape[1] - 1)
        truth = self.reference.gather(1, index)
        use = (torch.arange(k)[None] < lengths[:, None]) & (truth >= 0)
        return Proposal(torch.where(use, truth, proposal.tokens), proposal.scores)


def _batch(prompts, pad):
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def _prompts(batch, seed):
    rng = random.Random(seed)
    return [[rng.randrange(0, 120) for _ in range(rng.randint(1, 9))] for _ in range(batch)]


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_batched_greedy_rows_equal_single_row_generate(targets, family, batch):
    target = targets[family]
    draft = draft_for(target)
    prompts = _prompts(batch, seed=batch)
    singles = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompts]
    ids, mask = _batch(prompts, pad=0)
    strategies = {"dmtp": DMTPDrafter(draft, draft.native_mtp), "mtp3": MTPDrafter(draft.native_mtp, 3)}
    if batch == 4:
        dflash = draft_for(target, anchor_layout="dflash")
        strategies["dflash"] = DFlashDrafter(dflash)
    eos = target.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else eos) if eos is not None else None
    for name, drafter in strategies.items():
        oracle = BatchOracle(drafter, singles, seed=batch)
        stats = SpecStats(drafter.num_candidates, name)
        out, stats = speculative_decode(
            target,
            ids,
            oracle,
            max_length=ids.shape[1] + MAX_NEW,
            attention_mask=mask,
            eos_token_id=eos,
            pad_token_id=0,
            stats=stats,
        )
        for row, prompt in enumerate(prompts):
            expected = singles[row][len(prompt) :]
            generated = out[row, ids.shape[1] : ids.shape[1] + expected.shape[0]]
            assert torch.equal(generated, expected), (family, batch, name, row)
        assert len(stats.requests) == batch
        assert sum(1 for count in stats.hist if count) >= 3  # ragged: many different acceptance lengths


def test_batched_rows_finish_independently_at_eos(targets):
    target = targets["qwen3_5_moe"]
    draft = draft_for(target)
    prompts = _prompts(4, seed=7)
    plain = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompts]
    eos = int(plain[1][len(prompts[1]) + 3])  # row 1 stops after 4 tokens (others may stop too)
    singles = [
        target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)[0]
        for p in prompts
    ]
    ids, mask = _batch(prompts, pad=0)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=0,
    )
    lengths = set()
    for row, prompt in enumerate(prompts):
        expected = singles[row][len(prompt) :]
        lengths.add(expected.shape[0])
        got = out[row, ids.shape[1] : ids.shape[1] + expected.shape[0]]
        assert torch.equal(got, expected), row
        assert (out[row, ids.shape[1] + expected.shape[0] :] == 0).all()  # padded after its own EOS
    assert len(lengths) >= 2  # rows really finished at different times

    # finished rows leave the batch: later rounds run on fewer rows, and the output is unchanged
    batch_sizes = []

    class RowCounter(DrafterWrapper):  # the batch size of every round
        def propose(self, anchor_ids, *args):
            batch_sizes.append(anchor_ids.shape[0])
            return super().propose(anchor_ids, *args)

    direct, _ = speculative_decode(
        target,
        ids,
        RowCounter(DMTPDrafter(draft, draft.native_mtp)),
        max_length=ids.shape[1] + MAX_NEW,
        attention_mask=mask,
        eos_token_id=torch.tensor([eos]),
        pad_token_id=0,
    )
    assert torch.equal(direct, out[:, : direct.shape[1]])
    assert batch_sizes[0] == 4 and min(batch_sizes) < 4
