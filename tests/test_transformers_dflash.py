"""Our DFlash weights in Transformers' own DFlash path (``speculation_type="dflash"``): a peer in ``dmtp bench``."""

from __future__ import annotations

import pytest
import torch
from conftest import draft_for, tiny_qwen3_target

from dmtp_hf import DMTPDraftModel
from dmtp_hf.bundled import default_paths
from dmtp_hf.modeling.engine_export import transformers_dflash_assistant


def test_the_converted_assistant_computes_our_dflash_forward():
    draft = DMTPDraftModel.from_pretrained(default_paths()["dflash"]).float()
    assistant = transformers_dflash_assistant(draft)
    generator = torch.Generator().manual_seed(0)
    hidden = draft.config.hidden_size
    features = torch.randn(2, 9, hidden * len(draft.config.dflash_config["target_layer_ids"]), generator=generator)
    block = torch.randn(2, 8, hidden, generator=generator)
    positions = torch.arange(17)[None].expand(2, -1)
    ours = draft(inputs_embeds=block, context_features=features, position_ids=positions).last_hidden_state
    theirs = assistant(noise_embeds=block, context_hidden_states=features, position_ids=positions).last_hidden_state
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert assistant.config.block_size == draft.config.dmtp_config["num_candidates"] + 1


def test_transformers_dflash_path_runs_our_weights_losslessly():
    target = tiny_qwen3_target()
    draft = draft_for(target, anchor_layout="dflash", fusion="none", target_layer_ids=[0, 2])
    assistant = transformers_dflash_assistant(draft)
    blocks = []
    assistant.register_forward_hook(
        lambda module, args, kwargs, out: blocks.append(kwargs["noise_embeds"].shape), with_kwargs=True
    )
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
    spec = target.generate(
        prompt, do_sample=False, max_new_tokens=30, assistant_model=assistant, speculation_type="dflash"
    )
    assert torch.equal(spec, plain)
    assert blocks and all(shape[1] == 8 for shape in blocks)  # it drafted, blocks of K + 1 = 8 slots


def test_drafts_transformers_cannot_run_are_refused_with_the_reason():
    target = tiny_qwen3_target()
    with pytest.raises(ValueError, match="runs plain DFlash drafts; this one is anchor_layout='dual'"):
        transformers_dflash_assistant(draft_for(target, anchor_layout="dual"))
    vocabulary = draft_for(target, anchor_layout="dflash", fusion="none", draft_vocab_size=64)
    with pytest.raises(ValueError, match="64-token draft vocabulary"):
        transformers_dflash_assistant(vocabulary)
