"""`dmtp_vllm.native`: a family's own MTP head is read from the target checkpoint (no engine starts here)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dmtp_vllm.native import NATIVE_FAMILIES, first_candidate, target_mtp_tensors


def test_the_head_is_read_from_the_shards_that_hold_it_without_vocabulary_copies(tmp_path):
    """A sharded DeepSeek-style checkpoint: the trunk's shard is never opened (the index says where the head is), and
    the head's copies of the embedding and LM head are left out (the target's own are used)."""
    depth = 2
    head = f"model.layers.{depth}."
    trunk = {"model.embed_tokens.weight": torch.zeros(8, 4), "model.layers.0.mlp.weight": torch.zeros(4, 4)}
    mtp = {head + "eh_proj.weight": torch.ones(4, 8), head + "embed_tokens.weight": torch.zeros(8, 4)}
    mtp[head + "shared_head.head.weight"] = torch.zeros(8, 4)
    save_file(mtp, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"not a safetensors file: never opened")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in trunk}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in mtp})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    pattern = NATIVE_FAMILIES["deepseek_v3"].tensors.format(N=depth)
    read = dict(target_mtp_tensors(tmp_path, pattern))
    assert list(read) == [head + "eh_proj.weight"] and torch.equal(read[head + "eh_proj.weight"], torch.ones(4, 8))


def test_a_target_without_its_head_is_refused_by_name(tmp_path):
    """A checkpoint saved without the head (or a family's layout named wrongly) says what it lacks."""
    save_file({"model.layers.0.mlp.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds no MTP head tensors.*mtp"):
        list(target_mtp_tensors(tmp_path, NATIVE_FAMILIES["qwen3_next"].tensors))


def test_first_candidate_maps_a_draft_vocabulary_to_target_ids():
    """T1 over a draft vocabulary's LM head rows is the target id of the best row; its confidence that row's share."""
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    rows = torch.tensor([[0.0, 1.0], [3.0, 0.0]])  # the LM head's rows of target tokens 7 and 3
    t1, confidence = first_candidate(g, rows, token_ids=torch.tensor([7, 3]))
    assert t1.tolist() == [3, 7]
    assert confidence.tolist() == pytest.approx((g @ rows.t()).softmax(-1).max(-1).values.tolist())
