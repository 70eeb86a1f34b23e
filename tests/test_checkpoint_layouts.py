"""Real checkpoint layouts, in miniature: every layout loads with the semantics engines give it, or is refused with
an error naming what is unsupported. The facts (field names, values, tensor names) come from the public configs."""

import json

import pytest
import torch
from conftest import HIDDEN, VOCAB, assert_decodes_as_plain_generate, tiny_qwen3_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_modeling import write_dflash_checkpoint

from dmtp_hf import DMTPDraftModel
from dmtp_hf.cli import main
from dmtp_hf.modeling.native_mtp import load_native_mtp
from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target, read_checkpoint_tensors


def rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return config


def test_current_zlab_qwen35_dflash_sliding_layers_are_causal_in_the_block(tmp_path, target):
    # dflash_config holds block_size 16, the mask id and the target layers; 5 sliding layers then 1 full one;
    # rope_parameters; no embedding, no LM head.
    write_dflash_checkpoint(tmp_path, num_layers=6, target_layer_ids=(0, 1, 2, 3), sliding=True)
    config = rewrite_config(
        tmp_path,
        block_size=None,
        rope_theta=None,
        dflash_config={"block_size": 16, "mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1, 2, 3]},
        rope_parameters={"rope_theta": 10000000.0, "rope_type": "default"},
        sliding_window=4096,
    )
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target, anchor_layout="dflash")
    assert draft.config.block_size == 16 and draft.config.target_layer_ids == [0, 1, 2, 3]
    assert draft.config.rope_parameters["rope_theta"] == 10000000.0
    kinds = [(layer.self_attn.block_causal, layer.self_attn.sliding_window) for layer in draft.layers]
    assert kinds == [(True, 4096)] * 5 + [(False, None)]  # vLLM/SGLang: sliding = causal within the block


def test_older_zlab_dflash_top_level_block_size_all_full_attention(tmp_path, target):
    write_dflash_checkpoint(tmp_path, num_layers=2)
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target, anchor_layout="dflash")
    assert draft.config.block_size == 16
    assert all(not layer.self_attn.block_causal and layer.self_attn.sliding_window is None for layer in draft.layers)
    assert draft.config.rope_parameters["rope_theta"] == 10000.0


def test_zlab_dflash_checkpoint_decodes_as_dflash_with_its_block_by_default(tmp_path, target):
    """Nothing but ``target=``: a 16-slot DFlash checkpoint is a DFlash draft proposing 15 candidates per round
    (no MTP head needed); DMTP on its weights is an explicit request, and says what to do without a head."""
    write_dflash_checkpoint(tmp_path, num_layers=2)
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target)
    assert (draft.config.anchor_layout, draft.config.fusion, draft.config.num_candidates) == ("dflash", "none", 15)
    assert_decodes_as_plain_generate(target, draft, num_candidates=15, strategy="dflash")
    assert DMTPDraftModel.from_pretrained(tmp_path, num_candidates=7).config.num_candidates == 7
    with pytest.raises(ValueError, match=r"has no native MTP head.*load it without anchor_layout="):
        DMTPDraftModel.from_pretrained(tmp_path, target=target, anchor_layout="dual")  # refused at load
    dmtp = DMTPDraftModel.from_pretrained(tmp_path, anchor_layout="dual").bind(target)  # bound by hand: at generate
    assert (dmtp.config.anchor_layout, dmtp.config.fusion) == ("dual", "residual") and dmtp.fusion.is_noop()
    with pytest.raises(RuntimeError, match="anchor_layout='dflash' to decode it as DFlash"):
        target.generate(torch.tensor([[5, 17, 42]]), assistant_model=dmtp, do_sample=False, max_new_tokens=4)


def test_gpt_oss_dflash_with_attention_bias_loads(tmp_path, target):
    tensors = write_dflash_checkpoint(tmp_path, num_layers=2)
    for i in range(2):
        for proj, size in (("q_proj", HIDDEN), ("k_proj", HIDDEN // 2), ("v_proj", HIDDEN // 2), ("o_proj", HIDDEN)):
            tensors[f"layers.{i}.self_attn.{proj}.bias"] = torch.randn(size) * 0.1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    rewrite_config(tmp_path, model_type="gpt_oss", attention_bias=True, block_size=8)
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target, anchor_layout="dflash")
    assert draft.config.block_size == 8 and draft.config.attention_bias
    assert torch.equal(draft.layers[1].self_attn.k_proj.bias, tensors["layers.1.self_attn.k_proj.bias"])


def test_config_without_num_target_layers_takes_it_from_the_bound_target(tmp_path):
    write_dflash_checkpoint(tmp_path, num_layers=2, target_layer_ids=(0, 2))
    rewrite_config(tmp_path, num_target_layers=None)
    draft = DMTPDraftModel.from_pretrained(tmp_path, anchor_layout="dflash")
    assert draft.config.num_target_layers is None
    draft.bind(tiny_qwen3_target(num_layers=4))
    assert draft.config.num_target_layers == 4  # the target's depth, not the draft's 2 layers
    with pytest.raises(ValueError, match="out of range"):
        DMTPDraftModel.from_pretrained(tmp_path, anchor_layout="dflash").bind(tiny_qwen3_target(num_layers=2))


def test_incomplete_dflash2_config_is_refused_naming_what_is_missing(tmp_path):
    tensors = write_dflash_checkpoint(tmp_path, num_layers=2)
    tensors["candidate_selector.hidden_projection.weight"] = torch.zeros(4, HIDDEN)
    tensors["layers.0.attention_conv.base_kernel"] = torch.zeros(2, HIDDEN)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    rewrite_config(
        tmp_path,
        architectures=["DFlash2DraftModel"],
        dflash_config={
            "mask_token_id": VOCAB - 1,
            "target_layer_ids": [0, 2],
            "selector_top_k": 16,
            "conv_kernel_size": 2,
        },
    )
    with pytest.raises(ValueError, match="DFlash2 needs .*conv_group_size=None.*selector_rank=None"):
        DMTPDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("family,tied", [("qwen3_5", True), ("qwen3_5_moe", False)])
def test_qwen35_packaged_as_conditional_generation(tmp_path, family, tied):
    path = make_tiny_target(family, tmp_path / family)
    names = list(read_checkpoint_tensors(path))
    assert any(n.startswith("model.language_model.") for n in names)
    mtp = [n for n in names if n.startswith("mtp.")]
    if family == "qwen3_5":
        assert len(mtp) == 15  # fc, 3 norms, the layer's 2 norms + 6 attention + 3 MLP tensors
    assert ("lm_head.weight" in names) is not tied  # 4B ties its LM head, 9B does not
    target = load_tiny_target(path)
    head = load_native_mtp(target)
    assert head.lm_head is target.get_output_embeddings()


def test_qwen35_moe_mtp_experts_load_stacked_or_per_expert(tmp_path):
    stacked = make_tiny_target("qwen3_5_moe", tmp_path / "stacked")
    head = load_native_mtp(load_tiny_target(stacked))
    tensors = load_file(str(stacked / "model.safetensors"))
    gate_up, down = (
        tensors.pop("mtp.layers.0.mlp.experts.gate_up_proj"),
        tensors.pop("mtp.layers.0.mlp.experts.down_proj"),
    )
    intermediate = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :intermediate].contiguous()
        tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = gate_up[e, intermediate:].contiguous()
        tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e].contiguous()
    save_file(tensors, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    per_expert = load_native_mtp(load_tiny_target(stacked))
    for name, tensor in head.state_dict().items():
        assert torch.equal(per_expert.state_dict()[name], tensor), name


def test_convert_to_dflash_writes_what_engines_read(tmp_path, target):
    write_dflash_checkpoint(tmp_path / "src", num_layers=2)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dmtp")]) == 0
    assert main(["convert", str(tmp_path / "dmtp"), str(tmp_path / "out"), "--to", "dflash"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_target_layers"] == 4
    assert config["block_size"] == config["dflash_config"]["block_size"] == 16  # both places: converters differ
    assert config["dflash_config"]["mask_token_id"] == VOCAB - 1 and config["dflash_config"]["target_layer_ids"]
    assert "auto_map" not in config and "dmtp_config" not in config
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("model.", "fusion.")) or "embed_tokens" in n or "lm_head" in n for n in names)
    reloaded = DMTPDraftModel.from_pretrained(tmp_path / "out", target=target, anchor_layout="dflash")
    assert reloaded.config.loaded_from_dflash
