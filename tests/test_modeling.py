"""Foundation: DMTPConfig / DMTPDraftModel, DFlash checkpoint compatibility, attention semantics, errors."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, VOCAB, draft_for, tiny_draft_config, tiny_qwen3_target
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from dmtp_hf import DMTPConfig, DMTPDraftModel
from dmtp_hf.modeling import dflash_visibility
from dmtp_hf.modeling.attention_masks import attention_mask_for_implementation
from dmtp_hf.modeling.native_mtp.retrofit import new_mtp_head

# ----------------------------------------------------------------------------------------------------
# A DFlash checkpoint written by hand in the z-lab / SpecForge layout


def write_dflash_checkpoint(
    path: Path,
    *,
    nested_block_size: bool = False,
    stray_tensors: torch.nn.Module | None = None,
    num_layers: int = 2,
    target_layer_ids=(0, 2),
    sliding: bool = False,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    H, heads, kv_heads, hd, inter = HIDDEN, 4, 2, HIDDEN // 4, 2 * HIDDEN

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "fc.weight": rnd(H, len(target_layer_ids) * H),
        "hidden_norm.weight": 1 + rnd(H, scale=0.1),
        "norm.weight": 1 + rnd(H, scale=0.1),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": 1 + rnd(H, scale=0.1),
                p + "post_attention_layernorm.weight": 1 + rnd(H, scale=0.1),
                p + "self_attn.q_proj.weight": rnd(heads * hd, H),
                p + "self_attn.k_proj.weight": rnd(kv_heads * hd, H),
                p + "self_attn.v_proj.weight": rnd(kv_heads * hd, H),
                p + "self_attn.o_proj.weight": rnd(H, heads * hd),
                p + "self_attn.q_norm.weight": 1 + rnd(hd, scale=0.1),
                p + "self_attn.k_norm.weight": 1 + rnd(hd, scale=0.1),
                p + "mlp.gate_proj.weight": rnd(inter, H),
                p + "mlp.up_proj.weight": rnd(inter, H),
                p + "mlp.down_proj.weight": rnd(H, inter),
            }
        )
    on_disk = dict(tensors)
    if stray_tensors is not None:  # early Qwen3.6 DFlash previews shipped copies of their target's
        on_disk["embed_tokens.weight"] = stray_tensors.get_input_embeddings().weight.detach().clone()
        on_disk["lm_head.weight"] = stray_tensors.get_output_embeddings().weight.detach().clone()
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "num_target_layers": 4,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": list(target_layer_ids)},
        "hidden_size": H,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "use_sliding_window": sliding,
        "sliding_window": 3 if sliding else None,
        "max_window_layers": num_layers,
        "layer_types": (["sliding_attention"] * (num_layers - 1) + ["full_attention"])
        if sliding
        else ["full_attention"] * num_layers,
        "dtype": "float32",
        "use_cache": True,
    }
    if nested_block_size:
        config["dflash_config"]["block_size"] = 16
    else:
        config["block_size"] = 16
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(on_disk, str(path / "model.safetensors"))
    return tensors


def reference_dflash_logits(
    t: dict[str, torch.Tensor],
    block_embeds: torch.Tensor,  # [Q, H]
    context_feats: torch.Tensor,  # [C, kH]
    block_start: int,
    lm_head: torch.Tensor,
    num_layers: int = 2,
    window: int | None = None,
) -> torch.Tensor:
    """DFlash forward from raw tensors: context K/V injection, bidirectional block, RoPE, GQA."""
    heads, kv_heads, hd, eps, theta = 4, 2, HIDDEN // 4, 1e-6, 10000.0

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):  # x [n, heads, hd]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    C, Q = context_feats.shape[0], block_embeds.shape[0]
    ctx = rms(context_feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    ctx_pos, blk_pos = torch.arange(C), torch.arange(block_start, block_start + Q)
    x = block_embeds
    for i in range(num_layers):
        p = f"layers.{i}."
        xn = rms(x, t[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, xn])
        q = rms((xn @ t[p + "self_attn.q_proj.weight"].T).view(Q, heads, hd), t[p + "self_attn.q_norm.weight"])
        k = rms(
            (kv_in @ t[p + "self_attn.k_proj.weight"].T).view(C + Q, kv_heads, hd),
            t[p + "self_attn.k_norm.weight"],
        )
        v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).view(C + Q, kv_heads, hd)
        q, k = rope(q, blk_pos), rope(k, torch.cat([ctx_pos, blk_pos]))
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        if window is not None and i < num_layers - 1:  # sliding layers: causal in block + window
            kpos = torch.cat([ctx_pos, blk_pos])
            is_ctx = torch.arange(C + Q) < C
            ok = (blk_pos[:, None] - kpos[None] < window) & (is_ctx[None] | (kpos[None] <= blk_pos[:, None]))
            scores = scores.masked_fill(~ok[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(Q, heads * hd)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        xn = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(xn @ t[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (xn @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["norm.weight"]) @ lm_head.T


def context_features(target, ids, layer_ids):
    out = target(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


# ----------------------------------------------------------------------------------------------------
# Save / load


@pytest.mark.parametrize(
    "layout,fusion",
    [("dual", "residual"), ("dual", "replace"), ("single", "hidden_residual"), ("dflash", "none")],
)
def test_save_pretrained_round_trip_is_exact(tmp_path, target, layout, fusion):
    draft = DMTPDraftModel(tiny_draft_config(anchor_layout=layout, fusion=fusion))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # make every tensor (fusion included) non-trivial
    draft.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["config.json", "model.safetensors"]
    loaded = DMTPDraftModel.from_pretrained(tmp_path, target=target, native_mtp=new_mtp_head(target))  # Qwen3: no head
    drop = {"_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k not in drop} == {
        k: v for k, v in draft.config.to_dict().items() if k not in drop
    }
    a, b = draft.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.config.anchor_layout == layout and loaded.config.fusion == fusion


def test_registered_with_auto_classes(tmp_path):
    draft = DMTPDraftModel(tiny_draft_config())
    draft.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DMTPConfig)
    assert isinstance(AutoModel.from_pretrained(tmp_path), DMTPDraftModel)


@pytest.mark.parametrize("nested", [False, True])
def test_dflash_checkpoint_matches_reference_forward(tmp_path, target, nested):
    raw = write_dflash_checkpoint(tmp_path, nested_block_size=nested, stray_tensors=target)
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target, anchor_layout="dflash", num_candidates=7)
    assert draft.config.block_size == 16 and draft.config.anchor_layout == "dflash"
    assert draft.fusion is None

    ids = torch.randint(0, VOCAB - 1, (1, 9))
    feats = context_features(target, ids, [0, 2])  # [1, 9, 2H]
    anchor = torch.tensor([7])
    block = draft.block_embeddings(anchor)  # [A, MASK x 7]
    assert block.shape == (1, 8, HIDDEN)
    pos = torch.cat([torch.arange(9), draft.block_position_ids(torch.tensor([9]))[0]])[None]
    with torch.no_grad():
        hidden = draft(block, feats, pos).last_hidden_state
        ours = draft.compute_logits(hidden)[0]
        embed = target.get_input_embeddings().weight
        ref_block = embed[torch.tensor([7] + [VOCAB - 1] * 7)]
        ref = reference_dflash_logits(raw, ref_block, feats[0], 9, target.lm_head.weight)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_dflash_sliding_window_layers_match_reference(tmp_path, target):
    raw = write_dflash_checkpoint(tmp_path, sliding=True)
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target, anchor_layout="dflash", num_candidates=7)
    assert draft.layers[0].self_attn.block_causal and not draft.layers[1].self_attn.block_causal
    ids = torch.randint(0, VOCAB - 1, (1, 9))
    feats = context_features(target, ids, [0, 2])
    pos = torch.cat([torch.arange(9), torch.arange(9, 17)])[None]
    with torch.no_grad():
        block = draft.block_embeddings(torch.tensor([3]))
        ours = draft.compute_logits(draft(block, feats, pos).last_hidden_state)[0]
        ref_block = target.get_input_embeddings().weight[torch.tensor([3] + [VOCAB - 1] * 7)]
        ref = reference_dflash_logits(raw, ref_block, feats[0], 9, target.lm_head.weight, window=3)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_dflash_checkpoint_round_trips_in_dflash_layout(tmp_path, target):
    raw = write_dflash_checkpoint(tmp_path / "src")
    draft = DMTPDraftModel.from_pretrained(tmp_path / "src", anchor_layout="dual", num_candidates=7)
    assert draft.config.anchor_layout == "dual" and draft.config.fusion == "residual"
    assert draft.fusion.is_noop()  # zero-initialised: DMTP starts as "DFlash conditioned on T1"
    draft.save_dflash(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 16 and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2], "block_size": 16}
    assert "dmtp_config" not in config
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == raw.keys()
    assert all(torch.equal(written[k], raw[k]) for k in raw)


def test_dflash_layout_refuses_trained_fusion(tmp_path):
    draft = DMTPDraftModel(tiny_draft_config())
    with torch.no_grad():
        draft.fusion.proj.weight.fill_(0.1)
    with pytest.raises(ValueError, match="fusion"):
        draft.save_dflash(tmp_path)


# ----------------------------------------------------------------------------------------------------
# Fusion


def test_zero_init_residual_equals_unfused_backbone_until_trained(target):
    config = tiny_draft_config(anchor_layout="dual", fusion="residual")
    draft = DMTPDraftModel(config).bind(target)
    plain = DMTPDraftModel(tiny_draft_config(anchor_layout="dual", fusion="none")).bind(target)
    plain.load_state_dict({k: v for k, v in draft.state_dict().items() if not k.startswith("fusion.")})

    ids = torch.randint(0, VOCAB - 1, (2, 6))
    feats = context_features(target, ids, [0, 2]).detach()
    anchor, t1, mtp_hidden = torch.tensor([4, 9]), torch.tensor([11, 3]), torch.randn(2, HIDDEN)
    pos = torch.cat([torch.arange(6), torch.arange(6, 14)]).expand(2, -1)

    def run(model):
        return model(model.block_embeddings(anchor, t1, mtp_hidden), feats, pos).last_hidden_state

    with torch.no_grad():
        expected = plain(
            plain.embed(torch.cat([anchor[:, None], t1[:, None], torch.full((2, 6), VOCAB - 1)], 1)),
            feats,
            pos,
        )
        assert torch.equal(run(draft), run(plain))
        assert torch.equal(run(draft), expected.last_hidden_state)

    optimizer = torch.optim.SGD(draft.fusion.parameters(), lr=0.1)
    loss = draft.compute_logits(run(draft)[:, 2:]).logsumexp(-1).mean()
    loss.backward()
    assert draft.fusion.proj.weight.grad is not None and draft.fusion.proj.weight.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        assert not torch.allclose(run(draft), run(plain))


def test_block_layouts_and_positions(target):
    anchor, t1, h = torch.tensor([4]), torch.tensor([11]), torch.randn(1, HIDDEN)
    embed = target.get_input_embeddings().weight
    for layout, fusion, length, offset in [
        ("dflash", "none", 8, 0),
        ("single", "none", 7, 1),
        ("dual", "none", 8, 0),
    ]:
        draft = DMTPDraftModel(tiny_draft_config(anchor_layout=layout, fusion=fusion)).bind(target)
        block = draft.block_embeddings(anchor, t1, h)
        assert block.shape == (1, length, HIDDEN)
        first = {"dflash": [4], "single": [11], "dual": [4, 11]}[layout]
        expected = embed[torch.tensor(first + [VOCAB - 1] * (length - len(first)))]
        assert torch.equal(block[0], expected)
        assert draft.block_position_ids(torch.tensor([20]))[0].tolist() == list(
            range(20 + offset, 20 + offset + length)
        )


def test_fusion_uses_detached_mtp_hidden(target):
    draft = DMTPDraftModel(tiny_draft_config(fusion="replace")).bind(target)
    h = torch.randn(1, HIDDEN, requires_grad=True)
    block = draft.block_embeddings(torch.tensor([1]), torch.tensor([2]), h)
    block.sum().backward()
    assert h.grad is None


# ----------------------------------------------------------------------------------------------------
# Attention semantics


def training_style_mask(seq_len: int, anchors: list[int], block_len: int, attn: str):
    """Keys: [context 0..S-1 | block_0 | block_1 ...]; queries: all blocks."""
    q_pos = torch.cat([torch.arange(a, a + block_len) for a in anchors])
    q_blk = torch.arange(len(anchors)).repeat_interleave(block_len)
    q_end = torch.tensor(anchors).repeat_interleave(block_len)
    k_pos = torch.cat([torch.arange(seq_len), q_pos])
    k_blk = torch.cat([torch.full((seq_len,), -1), q_blk])
    visible = dflash_visibility(q_pos[:, None], q_blk[:, None], q_end[:, None], k_pos[None], k_blk[None])
    return visible, attention_mask_for_implementation(visible[None, None], attn, torch.float32), q_pos


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
def test_block_sees_only_context_strictly_before_anchor_and_itself(target, attn):
    draft = DMTPDraftModel(tiny_draft_config(anchor_layout="dflash", fusion="none"))
    draft.set_attn_implementation(attn)
    draft.bind(target).eval()
    S, anchors, L = 12, [3, 8], 8
    visible, mask, q_pos = training_style_mask(S, anchors, L, attn)
    # strict: the anchor position itself is not visible from its block
    assert not visible[0, 3] and visible[0, 2] and not visible[8, 8] and visible[8, 7]
    assert not visible[0, S + L] and visible[0, S + L - 1]  # other blocks invisible, own block visible

    ids = torch.randint(0, VOCAB - 1, (1, S))
    feats = context_features(target, ids, [0, 2]).detach()
    blocks = torch.cat([draft.block_embeddings(ids[:, a]) for a in anchors], dim=1)
    pos = torch.cat([torch.arange(S), q_pos])[None]
    with torch.no_grad():
        base = draft(blocks, feats, pos, attention_mask=mask).last_hidden_state
        changed = feats.clone()
        changed[:, 8:] += 1.0  # at or after the second anchor
        out = draft(blocks, changed, pos, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out[:, L:], base[:, L:], rtol=0, atol=0)  # block 2 unaffected
        torch.testing.assert_close(out[:, :L], base[:, :L], rtol=0, atol=0)  # block 1 (anchor 3) too
        earlier = feats.clone()
        earlier[:, 5] += 1.0  # before anchor 8, after anchor 3
        out = draft(blocks, earlier, pos, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out[:, :L], base[:, :L], rtol=0, atol=0)
        assert not torch.allclose(out[:, L:], base[:, L:])
        # each block alone, with only its visible context, gives the same result (blocks see only themselves)
        single = draft(blocks[:, L:], feats[:, :8], torch.cat([torch.arange(8), q_pos[L:]])[None]).last_hidden_state
        torch.testing.assert_close(single, base[:, L:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_len", [16, 56])  # keys 24 and 72: 8 mod 16, where torch's CPU kernel misreads
def test_flex_attention_is_exact_at_key_lengths_the_cpu_kernel_misreads(target, context_len):
    """torch 2.13's compiled CPU FlexAttention reads past the last key when the key length is 8 mod 16 (NaN or
    wrong outputs that change with each compile); masks padded to whole blocks keep the draft exact."""
    draft = DMTPDraftModel(tiny_draft_config(anchor_layout="dflash", fusion="none")).bind(target).eval()
    ids = torch.randint(0, VOCAB - 1, (1, context_len))
    feats = context_features(target, ids, [0, 2]).detach()
    anchors = [context_len // 2]
    pos = torch.cat([torch.arange(context_len), torch.arange(anchors[0], anchors[0] + 8)])[None]
    outputs = {}
    for attn in ["sdpa", "flex_attention"]:
        draft.set_attn_implementation(attn)
        mask = training_style_mask(context_len, anchors, 8, attn)[1]
        with torch.no_grad():
            outputs[attn] = draft(draft.block_embeddings(ids[:, anchors[0]]), feats, pos, attention_mask=mask)
    assert mask.seq_lengths[1] % 128 == 0  # the BlockMask covers whole key blocks
    torch.testing.assert_close(
        outputs["flex_attention"].last_hidden_state, outputs["sdpa"].last_hidden_state, rtol=1e-5, atol=1e-5
    )


def test_attention_implementations_agree(target):
    ids = torch.randint(0, VOCAB - 1, (1, 10))
    feats = context_features(target, ids, [0, 2]).detach()
    draft = DMTPDraftModel(
        tiny_draft_config(
            anchor_layout="dflash",
            fusion="none",
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            use_sliding_window=True,
        )
    ).bind(target)
    pos = torch.cat([torch.arange(10), torch.arange(10, 18)])[None]
    outputs = {}
    for attn in ["eager", "sdpa", "flex_attention"]:
        draft.set_attn_implementation(attn)
        with torch.no_grad():
            outputs[attn] = draft(draft.block_embeddings(ids[:, -1]), feats, pos).last_hidden_state
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["flex_attention"], outputs["eager"], rtol=1e-4, atol=1e-4)


def test_incremental_context_cache_matches_full_context(target):
    draft = DMTPDraftModel(tiny_draft_config()).bind(target).eval()
    ids = torch.randint(0, VOCAB - 1, (1, 12))
    feats = context_features(target, ids, [0, 2]).detach()
    anchor, t1, h = ids[:, -1], torch.tensor([5]), torch.randn(1, HIDDEN)
    block = draft.block_embeddings(anchor, t1, h)
    with torch.no_grad():
        full = draft(block, feats, torch.arange(20)[None]).last_hidden_state
        cache = None
        out = draft(block, feats[:, :7], torch.cat([torch.arange(7), torch.arange(7, 15)])[None], use_cache=True)
        cache = out.cache
        assert cache.get_seq_length() == 7  # only context K/V are kept, never draft slots
        inc = draft(block, feats[:, 7:], torch.arange(7, 20)[None], cache=cache).last_hidden_state
        assert cache.get_seq_length() == 12
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Errors


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="anchor_layout"):
        tiny_draft_config(anchor_layout="triple")
    with pytest.raises(ValueError, match="fusion"):
        tiny_draft_config(fusion="concat")
    with pytest.raises(ValueError, match="fusion must be 'none'"):
        tiny_draft_config(anchor_layout="dflash", fusion="residual")
    with pytest.raises(ValueError, match="out of range"):
        tiny_draft_config(target_layer_ids=[0, 7])

    draft = DMTPDraftModel(tiny_draft_config())
    with pytest.raises(ValueError, match="hidden_size"):
        draft.bind(tiny_qwen3_target(hidden=48))
    with pytest.raises(ValueError, match="num_target_layers"):
        draft.bind(tiny_qwen3_target(num_layers=6))
    with pytest.raises(ValueError, match="target_layer_ids"):
        DMTPDraftModel(tiny_draft_config(num_target_layers=None, target_layer_ids=[0, 5])).bind(tiny_qwen3_target())
    with pytest.raises(ValueError, match="mask_token_id"):
        DMTPDraftModel(tiny_draft_config(mask_token_id=VOCAB + 3)).bind(tiny_qwen3_target())
    with pytest.raises(ValueError, match="[Vv]ocabulary"):
        DMTPDraftModel(tiny_draft_config(vocab_size=VOCAB + 32, mask_token_id=5)).bind(tiny_qwen3_target())
    with pytest.raises(RuntimeError, match="bind"):
        draft.block_embeddings(torch.tensor([1]), torch.tensor([2]), torch.randn(1, HIDDEN))
    with pytest.raises(ValueError, match="fc expects"):
        draft.project_context(torch.randn(1, 3, 3 * HIDDEN))


def test_loading_is_strict_about_shapes_and_missing_tensors(tmp_path):
    write_dflash_checkpoint(tmp_path / "wide", target_layer_ids=(0, 1, 2))
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2]  # fc on disk is 3H wide, config says 2H
    (tmp_path / "wide" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fc.weight"):
        DMTPDraftModel.from_pretrained(tmp_path / "wide")

    tensors = write_dflash_checkpoint(tmp_path / "missing")
    del tensors["layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        DMTPDraftModel.from_pretrained(tmp_path / "missing")

    # A DMTP checkpoint (not DFlash) must carry its fusion tensors
    draft = DMTPDraftModel(tiny_draft_config())
    draft.save_pretrained(tmp_path / "dmtp")
    tensors = load_file(str(tmp_path / "dmtp" / "model.safetensors"))
    del tensors["fusion.proj.weight"]
    save_file(tensors, str(tmp_path / "dmtp" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="fusion.proj.weight"):
        DMTPDraftModel.from_pretrained(tmp_path / "dmtp")

    write_dflash_checkpoint(tmp_path / "extra")
    tensors = load_file(str(tmp_path / "extra" / "model.safetensors"))
    tensors["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 2, HIDDEN)  # a DFlash2 tensor
    save_file(tensors, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(ValueError, match="attention_conv"):
        DMTPDraftModel.from_pretrained(tmp_path / "extra")


def test_fusionless_dmtp_checkpoint_loads_into_a_fusion_layout(tmp_path, target):
    """A draft trained with layout 'dflash' (saved in the DMTP format) is the start of DMTP-from-DFlash training."""
    dflash = DMTPDraftModel(tiny_draft_config(anchor_layout="dflash", fusion="none"))
    dflash.save_pretrained(tmp_path / "dflash")
    dual = DMTPDraftModel.from_pretrained(tmp_path / "dflash", anchor_layout="dual", fusion="residual")
    assert dual.fusion is not None and dual.fusion.is_noop()
    backbone = {k: v for k, v in dual.state_dict().items() if not k.startswith("fusion.")}
    assert all(torch.equal(v, dflash.state_dict()[k]) for k, v in backbone.items())


def test_missing_local_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint directory"):
        DMTPDraftModel.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="No checkpoint directory"):
        DMTPConfig.from_pretrained("./outputs/not/there")


def test_bind_casts_the_draft_to_the_target_dtype(target):
    target = target.to(torch.bfloat16)
    draft = draft_for(target)  # built in fp32, then bound
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    block = draft.block_embeddings(torch.tensor([5]), torch.tensor([6]), torch.zeros(1, target.config.hidden_size))
    assert block.dtype == torch.bfloat16


def test_rope_frequencies_stay_float32_when_the_draft_is_cast(target):
    draft = DMTPDraftModel(tiny_draft_config())
    exact = draft.rotary_emb.inv_freq.clone()
    assert exact.dtype == torch.float32
    draft.to(torch.bfloat16)
    assert draft.fc.weight.dtype == torch.bfloat16  # the weights are cast...
    for name in ("inv_freq", "original_inv_freq"):  # ...the frequencies are not
        assert getattr(draft.rotary_emb, name).dtype == torch.float32
        assert torch.equal(getattr(draft.rotary_emb, name), exact)
    bf16_target = tiny_qwen3_target().to(torch.bfloat16)
    bound = DMTPDraftModel(tiny_draft_config()).bind(bf16_target)  # bind casts the draft to the target's dtype
    assert bound.fc.weight.dtype == torch.bfloat16 and torch.equal(bound.rotary_emb.inv_freq, exact)
