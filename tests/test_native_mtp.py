"""Native MTP heads loaded from tiny targets in each family's real checkpoint layout (issue 3)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dmtp_hf.modeling.native_mtp.loading as loading
from dmtp_hf.assistant.drafters.state import MTPState
from dmtp_hf.modeling.native_mtp import (
    MissingMTPTensorsError,
    MTPLayout,
    NoNativeMTPError,
    TargetHiddenExtractor,
    UnsupportedMTPFamilyError,
    dequantize_block_fp8,
    get_mtp_layout,
    load_native_mtp,
    new_mtp_head,
    register_mtp_layout,
    resolve_mtp_layout,
    save_mtp_head,
)
from dmtp_hf_assets.tiny_targets import (
    FAMILIES,
    TINY_FP8_BLOCK,
    load_tiny_target,
    make_tiny_llama,
    make_tiny_target,
    read_checkpoint_tensors,
)


class RoundState(MTPState):
    """The MTP round state as these tests drive it: ``prefill`` starts afresh, ``advance`` continues."""

    def prefill(self, tokens, hidden, position_ids=None, attention_mask=None):
        self.reset()
        return self.consume(tokens, hidden, position_ids, attention_mask)

    def advance(self, tokens, hidden, position_ids=None, attention_mask=None):
        return self.consume(tokens, hidden, position_ids, attention_mask)


@pytest.fixture(autouse=True)
def no_grad():
    # Inference only; a fixture rather than a global switch so that other test modules are unaffected.
    with torch.no_grad():
        yield


# What the test itself knows about each family's checkpoint (written from the reference notes, not from the loader):
# prefix, names of (embedding norm, hidden norm, projection, final norm), block prefix, hidden-first, zero-centred.
FAMILY_FACTS = {
    "qwen3_5": ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), "layers.0.", False, True),
    "qwen3_5_moe": ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), "layers.0.", False, True),
    "qwen3_next": ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), "layers.0.", False, True),
    "deepseek_v3": ("model.layers.2.", ("enorm", "hnorm", "eh_proj", "shared_head.norm"), "", False, False),
    "glm4_moe": ("model.layers.2.", ("enorm", "hnorm", "eh_proj", "shared_head.norm"), "", False, False),
    "mimo": (
        "model.mtp_layers.0.",
        ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
        "",
        True,
        False,
    ),
}
FAMILY_FACTS["retrofit"] = (
    "mtp.",
    ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
    "layers.0.",
    False,
    False,
)
SHARED_COPIES = ("embed_tokens.", "shared_head.head.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (checkpoint path, target, head), built once per module."""
    cache = {}

    def get(family):
        if family not in cache:
            path = make_tiny_target(family, tmp_path_factory.mktemp(family), seed=0)
            target = load_tiny_target(path)
            cache[family] = (path, target, load_native_mtp(target))
        return cache[family]

    return get


def prompt_ids(batch=1, length=7, seed=0):
    return torch.randint(2, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def target_hidden(target, ids):
    return target(ids, output_hidden_states=True).hidden_states[-1]


# ----------------------------------------------------------------------------------------------------------------
# Hand-written reference from the raw checkpoint tensors


def rms_norm(x, weight, eps, zero_centred):
    x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return x_hat * (1.0 + weight.float()) if zero_centred else x_hat * weight.float()


def reference_logits(family, target, raw, ids_next, hidden, positions):
    """g_t and logits for pairs (ids_next[t], hidden[t]) at ``positions``, computed by hand from ``raw``."""
    prefix, (e_name, h_name, proj_name, out_name), block_prefix, hidden_first, zero_centred = FAMILY_FACTS[family]
    text_config = target.config.get_text_config(decoder=True)
    eps = text_config.rms_norm_eps
    trunk = "model.language_model." if family.startswith("qwen3_5") else "model."
    embedding = raw[trunk + "embed_tokens.weight"]
    lm_head = raw.get("lm_head.weight", embedding)  # tied for the tiny qwen3_5

    mtp = {name[len(prefix) :]: tensor for name, tensor in raw.items() if name.startswith(prefix)}
    e = rms_norm(embedding[ids_next], mtp[e_name + ".weight"], eps, zero_centred)
    h = rms_norm(hidden, mtp[h_name + ".weight"], eps, zero_centred)
    u = torch.cat([h, e] if hidden_first else [e, h], dim=-1) @ mtp[proj_name + ".weight"].T

    # The block itself: the family's own decoder-layer class, one full-attention layer, weights set by hand.
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    for key, value in (("first_k_dense_replace", 0), ("mlp_only_layers", [])):
        if hasattr(config, key):
            setattr(config, key, value)
    block = type(target.get_decoder().layers[-1])(config, 0)
    specific = {e_name, h_name, proj_name, out_name}
    block_raw = {
        name[len(block_prefix) :]: tensor
        for name, tensor in mtp.items()
        if name.startswith(block_prefix)
        and name.rsplit(".", 1)[0] not in specific
        and not name.startswith(SHARED_COPIES)
    }
    state = {}
    for name, tensor in block_raw.items():
        if ".experts." in name and name.split(".experts.")[1][0].isdigit():
            continue
        state[name] = tensor
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if "mlp.experts.0.gate_proj.weight" in block_raw:
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [block_raw[f"mlp.experts.{i}.gate_proj.weight"], block_raw[f"mlp.experts.{i}.up_proj.weight"]]
                )
                for i in range(num_experts)
            ]
        )
        state["mlp.experts.down_proj"] = torch.stack(
            [block_raw[f"mlp.experts.{i}.down_proj.weight"] for i in range(num_experts)]
        )
    block.load_state_dict(state, strict=True)
    block.eval()

    n = u.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    position_embeddings = target.get_decoder().rotary_emb(u, positions)
    v = block(u, attention_mask=causal, position_ids=positions, position_embeddings=position_embeddings)
    g = rms_norm(v, mtp[out_name + ".weight"], eps, zero_centred)
    return g, g @ lm_head.T.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_head_matches_handwritten_reference(tiny, family):
    path, target, head = tiny(family)
    state = RoundState(head)
    raw = read_checkpoint_tensors(path)
    ids = prompt_ids(batch=2, length=7)
    hidden = target_hidden(target, ids)
    positions = torch.arange(6)[None].expand(2, -1)  # pair (x_{t+1}, h_t) sits at the position t of h_t

    g = state.prefill(ids[:, 1:], hidden[:, :-1])
    ref_g, ref_logits = reference_logits(family, target, raw, ids[:, 1:], hidden[:, :-1], positions)
    torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.logits(g), ref_logits, atol=1e-5, rtol=1e-5)
    logits, mtp_hidden = state.predict()
    torch.testing.assert_close(logits, ref_logits[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mtp_hidden, ref_g[:, -1], atol=1e-5, rtol=1e-5)

    # RoPE is shift-invariant: Transformers' convention (the token's position t + 1) gives the same logits.
    shifted = state.prefill(ids[:, 1:], hidden[:, :-1], position_ids=1)
    torch.testing.assert_close(head.logits(shifted), ref_logits, atol=1e-5, rtol=1e-5)

    # The head owns neither the embedding nor the LM head: they are the target's, not saved with the head.
    assert head.embed_tokens is target.get_input_embeddings() and head.lm_head is target.get_output_embeddings()
    assert not any("embed_tokens" in name or "lm_head" in name for name in head.state_dict())


def test_layout_details_are_the_families_own(tiny):
    # Zero-centred norms for Qwen3.5/Next (the +1 convention), the target's own classes, a full-attention block.
    for family in ("qwen3_5", "qwen3_next"):
        _, target, head = tiny(family)
        assert type(head.final_norm) is type(target.get_decoder().norm)
        assert hasattr(head.layer, "self_attn") and not hasattr(head.layer, "linear_attn")
    _, target, head = tiny("deepseek_v3")
    assert type(head.layer.mlp).__name__ == "DeepseekV3MoE"  # MoE although the tiny trunk's layer 0 is dense
    # In bf16 the router stays float32, as the target keeps it (`_keep_in_fp32_modules_strict`).
    bf16_head = load_native_mtp(target, dtype=torch.bfloat16)
    assert bf16_head.projection.weight.dtype == bf16_head.layer.self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert bf16_head.layer.mlp.gate.weight.dtype == torch.float32
    assert bf16_head.layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    _, _, head = tiny("mimo")
    assert head.hidden_first


# ----------------------------------------------------------------------------------------------------------------
# Against Transformers' own MtpModel (DeepSeek-V3, GLM)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_head_matches_transformers_mtp_model(tiny, family):
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    _, target, head = tiny(family)
    state = RoundState(head)
    reference = MtpModel.from_pretrained(target).eval()
    mtp_cache = MtpCache(config=target.config.get_mtp_config())
    ids = prompt_ids(length=9, seed=1)
    hidden = target_hidden(target, ids)

    # HF uses the token position (t + 1); ours the hidden's (t). Two chunks exercise both caches.
    ours, theirs = [], []
    for chunk in (slice(0, 5), slice(5, 8)):
        tokens, h = ids[:, 1:][:, chunk], hidden[:, :-1][:, chunk]
        positions = torch.arange(chunk.start, chunk.stop)[None]
        theirs.append(reference._project_to_logits(reference.forward_layer(0, h, positions + 1, mtp_cache, tokens)))
        step = state.prefill if chunk.start == 0 else state.advance  # advance: positions continue by themselves
        ours.append(head.logits(step(tokens, h)))
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(theirs, 1), atol=1e-5, rtol=1e-5)


def mtp1_greedy_decode(target, head, prompt, max_new_tokens):
    """Tiny MTP-1 speculative loop: MTP drafts T1, the target verifies [A, T1], accept/reject, advance the MTP."""
    from transformers import DynamicCache

    state = RoundState(head)
    cache = DynamicCache(config=target.config)
    out = target(prompt, cache=cache, output_hidden_states=True)
    sequence = torch.cat([prompt, out.logits[:, -1:].argmax(-1)], dim=1)
    state.prefill(sequence[:, 1:], out.hidden_states[-1])
    accepted = 0
    while sequence.shape[1] - prompt.shape[1] < max_new_tokens:
        draft = state.predict()[0].argmax(-1, keepdim=True)  # [1, 1]
        length = sequence.shape[1]  # A = sequence[:, -1] sits at position length - 1
        verify = torch.cat([sequence[:, -1:], draft], dim=1)
        out = target(
            verify, cache=cache, position_ids=torch.arange(length - 1, length + 1)[None], output_hidden_states=True
        )
        predicted = out.logits.argmax(-1)  # [1, 2]
        if predicted[0, 0] == draft[0, 0]:
            new_tokens, pairs = predicted[:, :2].clone(), 2  # T1 (== predicted[0, 0]) and the bonus token
            new_tokens[0, 0] = draft[0, 0]
            accepted += 1
        else:
            new_tokens, pairs = predicted[:, :1], 1
            cache.crop(-1)  # drop the rejected T1 from the target cache
        sequence = torch.cat([sequence, new_tokens], dim=1)
        state.advance(new_tokens, out.hidden_states[-1][:, :pairs])
    return sequence[:, : prompt.shape[1] + max_new_tokens], accepted


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp1_greedy_decoding_is_lossless(tiny, family):
    _, target, head = tiny(family)
    target.generation_config.eos_token_id = None
    total_accepted = 0
    for seed in range(3):
        prompt = prompt_ids(length=5, seed=seed)
        expected = target.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours, accepted = mtp1_greedy_decode(target, head, prompt, 16)
        assert torch.equal(ours, expected)
        total_accepted += accepted
    assert total_accepted > 0  # the accept branch (two pairs advanced) ran, not only rejections


# ----------------------------------------------------------------------------------------------------------------
# Cache semantics


def cache_kv(state):
    span = state.kv.span
    return state.kv.keys[0][:, :, :span].clone(), state.kv.values[0][:, :, :span].clone()


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_advance_after_partial_acceptance_equals_fresh_prefill(tiny, family):
    _, target, head = tiny(family)
    state = RoundState(head)
    committed = prompt_ids(length=10, seed=3)  # x_0 .. x_9: x_0..x_6 prompt + first token, then a round
    hidden = target_hidden(target, committed)

    state.prefill(committed[:, 1:7], hidden[:, :6])  # pairs t = 0..5, A = x_6
    drafts, _ = state.propose(3)  # temporary chained entries, rolled back
    assert state.num_committed == 6
    # "Verify" accepted 1 of the drafts (x_7) and produced the bonus x_8: pairs t = 6, 7. A third, rejected pair
    # (x_9, h_8) must leave no trace: it is never fed.
    state.advance(committed[:, 7:9], hidden[:, 6:8])
    kv_incremental = cache_kv(state)
    logits_incremental, g_incremental = state.predict()

    state.prefill(committed[:, 1:9], hidden[:, :8])
    kv_fresh = cache_kv(state)
    logits_fresh, g_fresh = state.predict()
    assert kv_incremental[0].shape == kv_fresh[0].shape == kv_fresh[0].shape[:2] + (8,) + kv_fresh[0].shape[3:]
    torch.testing.assert_close(kv_incremental, kv_fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_incremental, logits_fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_incremental, g_fresh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_next", "glm4_moe"])
def test_propose_chains_and_leaves_committed_cache_unchanged(tiny, family):
    _, target, head = tiny(family)
    state = RoundState(head)
    ids = prompt_ids(batch=2, length=8, seed=4)
    hidden = target_hidden(target, ids)
    state.prefill(ids[:, 1:], hidden[:, :-1])
    kv_before = cache_kv(state)
    logits_before, g_before = state.predict()

    drafts, draft_logits = state.propose(4)
    assert drafts.shape == (2, 4) and draft_logits.shape == (2, 4, 128)
    torch.testing.assert_close(cache_kv(state), kv_before, atol=0, rtol=0)
    assert state.num_committed == 7
    logits_after, g_after = state.predict()
    assert torch.equal(logits_after, logits_before) and torch.equal(g_after, g_before)
    assert torch.equal(drafts[:, 0], logits_before.argmax(-1))
    torch.testing.assert_close(draft_logits[:, 0], logits_before)

    # Step 2 is the pair (draft 1, g) at the next position: committing it by hand reproduces draft 2.
    state.consume(drafts[:, :1], g_before[:, None])
    step2_logits, _ = state.predict()
    torch.testing.assert_close(draft_logits[:, 1], step2_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(drafts[:, 1], step2_logits.argmax(-1))

    # A sampler callable is used for every step.
    state.prefill(ids[:, 1:], hidden[:, :-1])
    picked, _ = state.propose(3, select=lambda logits: logits.argsort(-1)[:, -2])  # second-best token
    assert torch.equal(picked[:, 0], logits_before.argsort(-1)[:, -2])


def test_padded_batch_advance_matches_unpadded_rows(tiny):
    _, target, head = tiny("deepseek_v3")
    state = RoundState(head)
    ids = prompt_ids(batch=2, length=9, seed=5)
    hidden = target_hidden(target, ids)

    def single_row(row, num_pairs):
        state.reset()
        state.consume(ids[row : row + 1, 1 : num_pairs + 1], hidden[row : row + 1, :num_pairs])
        return state.predict()[0][0]

    expected = {(0, 7): single_row(0, 7), (1, 6): single_row(1, 6), (0, 8): single_row(0, 8), (1, 7): single_row(1, 7)}
    state.prefill(ids[:, 1:6], hidden[:, :5])  # pairs t = 0..4
    # Row 0 accepted its draft (2 new pairs), row 1 did not (1 real pair + 1 padding slot).
    state.advance(ids[:, 6:8], hidden[:, 5:7], attention_mask=torch.tensor([[1, 1], [1, 0]]))
    logits, _ = state.predict()
    torch.testing.assert_close(logits[0], expected[(0, 7)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], expected[(1, 6)], atol=1e-5, rtol=1e-5)
    # Next round, one pair each: row 0's t = 7, row 1's t = 6 (positions continue per row).
    state.advance(torch.stack([ids[0, 8:9], ids[1, 7:8]]), torch.stack([hidden[0, 7:8], hidden[1, 6:7]]))
    logits, _ = state.predict()
    torch.testing.assert_close(logits[0], expected[(0, 8)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], expected[(1, 7)], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files: shards, FP8, errors


def test_sharded_checkpoint_opens_only_mtp_shards(tiny, tmp_path, monkeypatch):
    path = make_tiny_target("glm4_moe", tmp_path / "sharded", seed=0, sharded=True)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_shards = {shard for name, shard in weight_map.items() if name.startswith("model.layers.2.")}
    assert len(set(weight_map.values())) == 3 and len(mtp_shards) == 2  # MTP tensors straddle two of three shards

    opened = []

    def recording_safe_open(filename, *args, **kwargs):
        opened.append(str(filename).rsplit("/", 1)[-1])
        return safe_open(filename, *args, **kwargs)

    target = load_tiny_target(path)
    monkeypatch.setattr(loading, "safe_open", recording_safe_open)
    head = load_native_mtp(target)
    assert sorted(opened) == sorted(mtp_shards)

    # Same seed as the single-file checkpoint: the same head.
    _, _, single_file_head = tiny("glm4_moe")
    ids = prompt_ids(length=6, seed=7)
    hidden = target_hidden(target, ids)
    torch.testing.assert_close(
        head.logits(RoundState(head).prefill(ids[:, 1:], hidden[:, :-1])),
        single_file_head.logits(RoundState(single_file_head).prefill(ids[:, 1:], hidden[:, :-1])),
        atol=0,
        rtol=0,
    )


def dequantize_by_hand(weight, scale_inv, block):
    out = torch.empty(weight.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].float() * scale_inv[i, j]
    return out


def test_dequantize_block_fp8_handles_partial_blocks():
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 2, generator=torch.Generator().manual_seed(1)) + 0.5
    result = dequantize_block_fp8(weight, scale_inv, (16, 16))
    torch.testing.assert_close(result, dequantize_by_hand(weight, scale_inv, (16, 16)), atol=0, rtol=0)
    with pytest.raises(ValueError, match="does not match"):
        dequantize_block_fp8(weight, scale_inv[:2], (16, 16))


def test_fp8_mtp_weights_are_dequantized_on_load(tmp_path):
    path = make_tiny_target("deepseek_v3", tmp_path / "fp8", seed=0, fp8=True)
    raw = read_checkpoint_tensors(path)
    fp8_names = [name for name, tensor in raw.items() if tensor.dtype == torch.float8_e4m3fn]
    assert "model.layers.2.self_attn.q_b_proj.weight" in fp8_names and len(fp8_names) > 10
    dequantized = {name: tensor for name, tensor in raw.items() if not name.endswith("_scale_inv")}
    for name in fp8_names:
        dequantized[name] = dequantize_by_hand(raw[name], raw[name + "_scale_inv"], TINY_FP8_BLOCK)

    target = load_tiny_target(path)
    head = load_native_mtp(target)
    torch.testing.assert_close(
        head.layer.self_attn.q_b_proj.weight, dequantized["model.layers.2.self_attn.q_b_proj.weight"], atol=0, rtol=0
    )
    assert not any("scale" in name for name in head.state_dict())
    ids = prompt_ids(length=6, seed=2)
    hidden = target_hidden(target, ids)
    g = RoundState(head).prefill(ids[:, 1:], hidden[:, :-1])
    _, ref_logits = reference_logits(
        "deepseek_v3", target, dequantized, ids[:, 1:], hidden[:, :-1], torch.arange(5)[None]
    )
    torch.testing.assert_close(head.logits(g), ref_logits, atol=1e-5, rtol=1e-5)

    # Without a block size anywhere (config stripped), loading fails clearly instead of misreading the scales.
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block size is unknown"):
        load_native_mtp(load_tiny_target(path))
    # An FP8 weight without its scale is refused.
    with pytest.raises(ValueError, match="without a scale"):
        loading.dequantize_fp8_state_dict({"w.weight": raw[fp8_names[0]]}, TINY_FP8_BLOCK)


def test_missing_mtp_tensors_are_listed(tmp_path):
    path = make_tiny_target("deepseek_v3", tmp_path / "missing", seed=0)
    file = path / "model.safetensors"
    tensors = read_checkpoint_tensors(path)
    removed = [
        "model.layers.2.self_attn.q_b_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
        "model.layers.2.hnorm.weight",
    ]
    save_file(
        {name: tensor for name, tensor in tensors.items() if name not in removed}, str(file), metadata={"format": "pt"}
    )
    with pytest.raises(MissingMTPTensorsError) as error:
        load_native_mtp(load_tiny_target(path))
    message = str(error.value)
    assert "3 checkpoint tensor(s) missing" in message
    for name in removed:
        assert name in message


def test_target_without_mtp_head_is_refused(tmp_path):
    path = make_tiny_target("qwen3_next", tmp_path / "no_tensors", with_mtp=False)
    with pytest.raises(NoNativeMTPError, match=r"no tensor named mtp\.\*"):
        load_native_mtp(load_tiny_target(path))
    path = make_tiny_target("deepseek_v3", tmp_path / "zero_layers", config_overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(NoNativeMTPError, match="declares 0 MTP layers"):
        load_native_mtp(load_tiny_target(path))


def test_missing_local_head_folder_is_named(tmp_path):
    """A head path that does not exist (a head not trained yet) reads as a missing folder, not a bad Hub repo id."""
    target = load_tiny_target(make_tiny_target("qwen3_next", tmp_path / "target"))
    with pytest.raises(FileNotFoundError, match="No checkpoint directory at 'outputs/no/final_mtp_head'"):
        load_native_mtp(target, checkpoint="outputs/no/final_mtp_head")


def test_unsupported_family_is_named(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    target = LlamaForCausalLM(config)
    target.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedMTPFamilyError, match=r"'llama'.*deepseek_v3.*glm4_moe.*mimo.*qwen3_5.*qwen3_next"):
        load_native_mtp(target, tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# Hidden input, wrappers, registry


@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_vllm_folder_of_a_native_head_holds_no_copy_of_it(tiny, family, tmp_path):
    """A family's own head stays in the target checkpoint: the vLLM folder names it (layout, source "target") and
    carries only the draft's tensors; the plugin reads the head from the target, as vLLM's ``mtp`` method does."""
    from conftest import draft_for

    from dmtp_hf.modeling.engine_export import save_vllm_draft

    _, target, head = tiny(family)
    draft = draft_for(target)
    draft.bind(target, native_mtp=head)
    save_vllm_draft(draft, head, tmp_path / "vllm")
    with safe_open(str(tmp_path / "vllm" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    mtp = json.loads((tmp_path / "vllm" / "config.json").read_text())["dmtp_config"]["mtp"]
    assert mtp["layout"] == family and mtp["source"] == "target"
    assert not any(name.startswith("mtp.") for name in names) and any(name.startswith("fusion.") for name in names)


def test_a_tuned_native_head_is_sent_through_the_target_not_dropped_from_the_vllm_folder(tiny, tmp_path, capsys):
    """The plugin reads a family's own head from the target checkpoint, so `--mtp-head` with a tuned native head would
    be served as the untuned one: the export refuses it and names `dmtp export-mtp`."""
    from conftest import draft_for

    from dmtp_hf.cli import main

    path, target, head = tiny("qwen3_5")
    draft_for(target).save_pretrained(tmp_path / "draft")
    save_mtp_head(head, tmp_path / "head", target)
    command = ["convert", str(tmp_path / "draft"), str(tmp_path / "vllm"), "--to", "vllm", "--target", str(path)]
    assert main([*command, "--mtp-head", str(tmp_path / "head")]) != 0
    error = capsys.readouterr().err
    assert "is a tuned qwen3_5 head" in error and "`dmtp export-mtp" in error
    assert not (tmp_path / "vllm").exists()
    assert main(command) == 0  # the target's own head: nothing to copy


def test_post_and_pre_norm_target_hidden(tiny):
    _, target, _ = tiny("qwen3_5")
    ids = prompt_ids(length=6, seed=8)
    last_layer_output = []
    handle = target.get_decoder().layers[-1].register_forward_hook(lambda m, a, out: last_layer_output.append(out))
    try:
        with TargetHiddenExtractor(target, "post_norm") as post, TargetHiddenExtractor(target, "pre_norm") as pre:
            outputs = target(ids, output_hidden_states=True)
            post_hidden, pre_hidden = post(outputs), pre(outputs)
            assert torch.equal(post(), post_hidden)  # the hook capture equals hidden_states[-1]
    finally:
        handle.remove()
    assert torch.equal(post_hidden, outputs.hidden_states[-1])
    assert torch.equal(pre_hidden, last_layer_output[-1])
    assert not torch.allclose(pre_hidden, post_hidden)
    assert load_native_mtp(target, hidden_input="pre_norm").hidden_input == "pre_norm"
    with pytest.raises(ValueError, match="hidden_input"):
        load_native_mtp(target, hidden_input="final")


def test_multimodal_wrapper_target_loads_the_same_head(tiny):
    from transformers import AutoModelForImageTextToText

    path, target, head = tiny("qwen3_5")
    wrapper = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert type(wrapper).__name__ == "Qwen3_5ForConditionalGeneration"
    wrapper_head = load_native_mtp(wrapper)
    assert wrapper_head.embed_tokens is wrapper.model.language_model.embed_tokens
    ids = prompt_ids(length=6, seed=9)
    hidden = target_hidden(target, ids)
    torch.testing.assert_close(
        wrapper_head.logits(RoundState(wrapper_head).prefill(ids[:, 1:], hidden[:, :-1])),
        head.logits(RoundState(head).prefill(ids[:, 1:], hidden[:, :-1])),
        atol=1e-6,
        rtol=1e-6,
    )


def test_registry_adds_a_family_with_one_entry(tiny, monkeypatch, tmp_path):
    import shutil

    import dmtp_hf.modeling.native_mtp.layouts as layouts

    monkeypatch.setattr(layouts, "_MTP_LAYOUTS", dict(layouts._MTP_LAYOUTS))
    assert resolve_mtp_layout({"model_type": "mimo"}).name == "mimo"  # a real MiMo-7B config.json
    assert resolve_mtp_layout({"model_type": "qwen2", "architectures": ["MiMoForCausalLM"]}).name == "mimo"
    with pytest.raises(ValueError, match="already registered"):
        register_mtp_layout("deepseek_v3", get_mtp_layout("deepseek_v3"))
    with pytest.raises(ValueError, match="tensor_names"):
        MTPLayout(name="broken", prefix="mtp.", tensor_names={"projection": "fc"})

    # A plain Qwen2 target storing its MTP like MiMo: one registry entry, no code.
    path, _, mimo_head = tiny("mimo")
    register_mtp_layout(
        "qwen2",
        MTPLayout(
            name="qwen2_mtp",
            prefix="model.mtp_layers.0.",
            tensor_names={
                "embedding_norm": "token_layernorm",
                "hidden_norm": "hidden_layernorm",
                "projection": "input_proj",
                "final_norm": "final_layernorm",
            },
            hidden_first=True,
        ),
    )
    plain = shutil.copytree(path, tmp_path / "plain_qwen2")
    config = json.loads((plain / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (plain / "config.json").write_text(json.dumps(config))
    target = load_tiny_target(plain)
    head = load_native_mtp(target)
    ids = prompt_ids(length=6, seed=10)
    hidden = target_hidden(target, ids)
    assert head.layout.name == "qwen2_mtp"
    torch.testing.assert_close(
        head.logits(RoundState(head).prefill(ids[:, 1:], hidden[:, :-1])),
        mimo_head.logits(RoundState(mimo_head).prefill(ids[:, 1:], hidden[:, :-1])),
        atol=0,
        rtol=0,
    )


# ----------------------------------------------------------------------------------------------------------------
# Retrofitted heads: a new MTP head for a target that ships none (a tiny random Llama, SmolLM2's architecture)


@pytest.fixture(scope="module")
def retrofitted(tmp_path_factory):
    """(target, saved head directory, the head as trained): a perturbed new head, saved standalone."""
    root = tmp_path_factory.mktemp("llama")
    target = load_tiny_target(make_tiny_llama(root / "target"))
    head = new_mtp_head(target)
    with torch.no_grad():  # stands in for training: every tensor moves away from its initialisation
        for parameter in head.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return target, save_mtp_head(head, root / "head", target), head


def test_llama_target_has_no_native_head_until_one_is_retrofitted(retrofitted):
    target, directory, trained = retrofitted
    with pytest.raises(UnsupportedMTPFamilyError):
        load_native_mtp(target)
    head = load_native_mtp(target, checkpoint=directory)
    assert head.layout.name == "retrofit" and type(head.layer) is type(target.get_decoder().layers[-1])
    assert head.embed_tokens is target.get_input_embeddings() and head.lm_head is target.get_output_embeddings()
    assert all(torch.equal(t, trained.state_dict()[n]) for n, t in head.state_dict().items())
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    } <= names
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)


def test_retrofitted_head_matches_handwritten_reference(retrofitted):
    target, directory, _ = retrofitted
    head = load_native_mtp(target, checkpoint=directory)
    raw = {**read_checkpoint_tensors(directory), **target.state_dict()}
    ids = prompt_ids(batch=2, length=7)
    hidden = target_hidden(target, ids)
    positions = torch.arange(6)[None].expand(2, -1)
    g = RoundState(head).prefill(ids[:, 1:], hidden[:, :-1])
    ref_g, ref_logits = reference_logits("retrofit", target, raw, ids[:, 1:], hidden[:, :-1], positions)
    torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.logits(g), ref_logits, atol=1e-5, rtol=1e-5)


def test_retrofitted_head_advance_after_partial_acceptance_equals_fresh_prefill(retrofitted):
    target, directory, _ = retrofitted
    head = load_native_mtp(target, checkpoint=directory)
    committed = prompt_ids(length=10, seed=3)
    hidden = target_hidden(target, committed)
    state = RoundState(head)
    state.prefill(committed[:, 1:7], hidden[:, :6])
    state.propose(3)
    state.advance(committed[:, 7:9], hidden[:, 6:8])
    incremental = state.predict()[0]
    state.prefill(committed[:, 1:9], hidden[:, :8])
    torch.testing.assert_close(incremental, state.predict()[0], atol=1e-5, rtol=1e-5)


def test_retrofitted_head_drafts_losslessly_through_generate(retrofitted):
    from conftest import draft_for

    from dmtp_hf.assistant import MTPDrafter, speculative_decode

    target, directory, _ = retrofitted
    head = load_native_mtp(target, checkpoint=directory)
    prompt = prompt_ids(length=6, seed=4)
    with torch.enable_grad():
        draft = draft_for(target).bind(target, native_mtp=head)
    reference = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None)
    out = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(out, reference)
    for steps in (1, 3):
        out, _ = speculative_decode(target, prompt, MTPDrafter(head, steps), max_length=reference.shape[1])
        assert torch.equal(out, reference)
