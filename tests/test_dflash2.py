"""DFlash2 and DMTP(D2): z-lab DFlash2 checkpoints load strictly and round-trip, decode exactly like plain
``generate`` (batches, hybrid targets, both strategies, fast path on and off, logits processors), sample the
target's distribution with the walk's sparse q, and an identity-initialised DFlash2 proposes what DFlash does."""

import copy
import json

import pytest
import torch
from conftest import assert_decodes_as_plain_generate, draft_for
from safetensors.torch import load_file, save_file
from test_engine import OracleMix, greedy_reference
from test_fast_path import Recorder
from test_lossless import TEMPERATURE, chi_square_p, exact_distribution, sample_rejection

from dmtp_hf import DMTPDraftModel
from dmtp_hf.assistant import speculative_decode
from dmtp_hf.assistant.drafters.dflash import DFlashDrafter
from dmtp_hf.assistant.drafters.dmtp import DMTPDrafter

SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


def dflash2_draft(target, randomize: bool = True, seed: int = 3, top_k: int = 4, **overrides) -> DMTPDraftModel:
    """A DFlash2 draft for ``target`` (backbone dflash2); ``randomize``: convolutions and selector far from the
    identity, so that a broken conv or walk changes the proposals."""
    draft = draft_for(target, dflash_config={**SELECTOR, "selector_top_k": top_k}, **overrides)
    assert draft.config.backbone == "dflash2"
    if randomize:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in draft.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return draft.eval()


def write_zlab_dflash2(path, target) -> dict[str, torch.Tensor]:
    """A DFlash2 checkpoint exactly as z-lab writes one: DFlash2DraftModel config (sliding layers, is_causal false,
    the conv/selector keys in dflash_config), bare base_kernel / codebook tensors, no embedding or LM head."""
    draft = dflash2_draft(target, anchor_layout="dflash", fusion="none")
    tensors = {k: v.clone() for k, v in draft.state_dict().items() if "rotary_emb" not in k}
    text = target.config.get_text_config()
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": text.hidden_size,
        "intermediate_size": 2 * text.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": text.hidden_size // 4,
        "vocab_size": text.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["sliding_attention"],
        "sliding_window": 2048,
        "use_sliding_window": True,
        "is_causal": False,
        "num_target_layers": text.num_hidden_layers,
        "tie_word_embeddings": False,
        "dflash_config": {
            "block_size": 16,
            **SELECTOR,
            "output_multiplier": 0.5,
            "final_logit_softcapping": 20.0,
            "mask_token_id": text.vocab_size - 1,
            "target_layer_ids": [0, text.num_hidden_layers - 1],
        },
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_zlab_dflash2_checkpoint_loads_strictly_and_round_trips(tmp_path, targets):
    target = targets["qwen3_5"]
    raw = write_zlab_dflash2(tmp_path / "src", target)
    assert {"candidate_selector.predecessor_codebook", "layers.0.attention_conv.base_kernel"} <= raw.keys()
    draft = DMTPDraftModel.from_pretrained(tmp_path / "src", target=target, anchor_layout="dflash")
    assert draft.config.backbone == "dflash2" and draft.candidate_selector is not None
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in raw.items())
    draft.save_dflash(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert {k: config["dflash_config"][k] for k in SELECTOR} == SELECTOR
    assert config["dflash_config"]["output_multiplier"] == 0.5
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == raw.keys() and all(torch.equal(written[k], raw[k]) for k in raw)
    # DMTP(D2) on request: the same tensors plus a zero-initialised fusion
    dmtp = DMTPDraftModel.from_pretrained(tmp_path / "src", target=target, anchor_layout="dual")
    assert dmtp.config.anchor_layout == "dual" and dmtp.fusion.is_noop() and dmtp.config.backbone == "dflash2"


def test_zlab_dflash2_checkpoint_decodes_as_dflash2_with_its_block_by_default(tmp_path, targets):
    """Nothing but ``target=``: a 16-slot z-lab DFlash2 checkpoint proposes 15 candidates per round as DFlash2."""
    target = targets["qwen3_5"]
    write_zlab_dflash2(tmp_path, target)
    draft = DMTPDraftModel.from_pretrained(tmp_path, target=target)
    assert (draft.config.anchor_layout, draft.config.backbone, draft.config.num_candidates) == ("dflash", "dflash2", 15)
    assert_decodes_as_plain_generate(target, draft, num_candidates=15, strategy="dflash")


def test_incomplete_dflash2_checkpoint_is_refused_naming_the_tensor(tmp_path, targets):
    raw = write_zlab_dflash2(tmp_path, targets["qwen3_5"])
    del raw["candidate_selector.successor_codebook"], raw["layers.0.mlp_conv.base_kernel"]
    save_file(raw, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"candidate_selector\.successor_codebook.*mlp_conv\.base_kernel"):
        DMTPDraftModel.from_pretrained(tmp_path, anchor_layout="dflash")


@pytest.mark.parametrize("strategy", ["dflash", "dmtp"])
def test_dflash2_decodes_exactly_plain_generate(targets, strategy):
    target = targets["qwen3_5"]  # hybrid: GatedDeltaNet + attention
    layout = {"anchor_layout": "dflash", "fusion": "none"} if strategy == "dflash" else {}
    draft = dflash2_draft(target, **layout)
    rows = [[5, 17, 42, 9, 77, 3, 64], [11, 12], [90, 3, 14, 15, 92]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    for fast in (False, True):
        plain_one = greedy_reference(target, ids[:1])
        drafter = (DFlashDrafter if strategy == "dflash" else lambda d, **k: DMTPDrafter(d, d.native_mtp, **k))(
            draft, fixed_shapes=fast
        )
        out, stats = speculative_decode(
            target, ids[:1], OracleMix(drafter, plain_one, seed=1), max_length=plain_one.shape[1]
        )
        assert torch.equal(out, plain_one) and sum(stats.hist[1:]) > 0, (strategy, fast)
        plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
        out, _ = speculative_decode(target, ids, drafter, max_length=width + 16, attention_mask=mask, pad_token_id=0)
        assert torch.equal(out, plain[:, : out.shape[1]]), (strategy, fast)
    routed = target.generate(ids[:1], assistant_model=draft, do_sample=False, max_new_tokens=16)
    assert torch.equal(routed, target.generate(ids[:1], do_sample=False, max_new_tokens=16))


@pytest.mark.parametrize("layout", ["dflash", "dual"])
def test_identity_initialised_dflash2_proposes_what_dflash_proposes(targets, layout):
    target = targets["deepseek_v3"]
    fusion = {"fusion": "none"} if layout == "dflash" else {}
    dflash = draft_for(target, anchor_layout=layout, **fusion)
    config = copy.deepcopy(dflash.config)
    config.backbone = "dflash2"
    fresh = DMTPDraftModel(config).bind(target, native_mtp=dflash.native_mtp if layout != "dflash" else None)
    missing = fresh.load_state_dict(dflash.state_dict(), strict=False).missing_keys
    assert missing and all("conv" in k or "candidate_selector" in k for k in missing)
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3]])
    reference = greedy_reference(target, prompt)
    runs = []
    for draft in (dflash, fresh.eval()):
        drafter = DFlashDrafter(draft) if layout == "dflash" else DMTPDrafter(draft, draft.native_mtp)
        recorder = Recorder(OracleMix(drafter, reference, seed=4))
        out, stats = speculative_decode(target, prompt, recorder, max_length=reference.shape[1])
        assert torch.equal(out, reference)
        runs.append((recorder.proposals, stats.hist))
    assert len(runs[0][0]) == len(runs[1][0]) and runs[0][1] == runs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))


def test_dflash2_walk_samples_the_targets_distribution(vocab6):
    """Rejection sampling with the walk's q (zero outside its top-3 candidates): the output keeps the target's
    distribution, and the sparse q is what makes it exact."""
    target, prompt, steps, runs = vocab6, torch.tensor([[1, 2, 0]]), 2, 700
    draft = dflash2_draft(
        target,
        top_k=3,
        anchor_layout="dflash",
        fusion="none",
        num_candidates=3,
        num_hidden_layers=1,
        target_layer_ids=[0],
    )
    exact = exact_distribution(target, prompt, steps, TEMPERATURE)
    counts, accepted = sample_rejection(target, prompt, DFlashDrafter(draft), steps, runs, seed=7)
    assert accepted > runs // 20
    assert chi_square_p(counts, exact, runs) > 1e-3


def test_logits_processors_constrain_the_walk(targets):
    """Processors act on the draft scores before the top-k: a banned token is never a candidate, and the output is
    plain generate's (bad_words_ids, repetition_penalty)."""
    target = targets["qwen3_5"]
    draft = dflash2_draft(target, anchor_layout="dflash", fusion="none")
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    options = {"do_sample": False, "max_new_tokens": 20, "repetition_penalty": 1.3}
    free = target.generate(prompt, **options)
    banned = int(torch.mode(free[0, prompt.shape[1] :]).values)  # a token plain decoding does produce
    options["bad_words_ids"] = [[banned]]
    recorder = Recorder(DFlashDrafter(draft))
    out = target.generate(prompt, assistant_model=recorder, **options)
    assert torch.equal(out, target.generate(prompt, **options))
    assert recorder.proposals and all(not (p == banned).any() for p in recorder.proposals)
