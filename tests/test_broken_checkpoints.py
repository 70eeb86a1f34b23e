"""Checkpoints that Transformers would load although they are wrong are refused at load, naming the file, the field
or tensor, and what was expected (``modeling/validation.py``)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, draft_for, tiny_draft_config
from safetensors.torch import load_file, save_file
from test_checkpoint_layouts import rewrite_config
from test_modeling import write_dflash_checkpoint

import dmtp_hf.bundled
from dmtp_hf import DMTPConfig, DMTPDraftModel
from dmtp_hf.assistant.widths import Calibration
from dmtp_hf.modeling.draft_vocab import set_draft_vocabulary
from dmtp_hf.modeling.native_mtp.retrofit import new_mtp_head
from dmtp_hf.modeling.validation import check_acceptance_calibration

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
CALIBRATION = {"edges": [0.5, 1.0], "rates": [[0.2, 0.9], [0.1, 0.8]], "base_rates": [0.7, 0.5]}


def store_as_int(path: Path, name: str, file: str = "model.safetensors") -> None:
    """Rewrite one tensor of ``file`` as int32 (the values x100, as a bad quantisation or export would leave them)."""
    tensors = load_file(path / file)
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, str(path / file))


def shard(path: Path) -> None:
    """Split ``model.safetensors`` into two shards plus ``model.safetensors.index.json``, as large checkpoints are."""
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = dict(zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2 :]), strict=True))
    for file, keys in halves.items():
        save_file({key: tensors[key] for key in keys}, str(path / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {key: file for file, keys in halves.items() for key in keys}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def dmtp_layout(path: Path, **dmtp_config) -> None:
    """Make the DFlash checkpoint a DMTP one (a `dmtp_config`, layout 'dflash': no fusion tensors to add)."""
    rewrite_config(path, dmtp_config={"anchor_layout": "dflash", "fusion": "none", "num_candidates": 7, **dmtp_config})


DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


def dflash_config(**changes) -> dict:
    return {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2], **changes}


def sharded_int(path: Path) -> None:
    shard(path)
    store_as_int(path, "layers.1.mlp.down_proj.weight", SHARDS[1])  # sorted names: layers.1.* is in the 2nd shard


CASES = [
    # 1. integer storage for a floating-point parameter (cast silently: the weights truncated)
    pytest.param(
        lambda p: store_as_int(p, "layers.0.self_attn.q_proj.weight"),
        r"model\.safetensors: 'layers\.0\.self_attn\.q_proj\.weight' is stored as I32, expected a floating-point",
        id="int32-weight",
    ),
    pytest.param(
        sharded_int,
        r"model-00002-of-00002\.safetensors: 'layers\.1\.mlp\.down_proj\.weight' is stored as I32, expected a floa",
        id="int32-weight-sharded",
    ),
    # 3. config fields of the wrong type or value
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(target_layer_ids=[True, 3])),
        r"config\.json: target_layer_ids must be non-negative integers \(not booleans\), got \[True, 3\]",
        id="bool-target-layer-id",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(target_layer_ids=[-1, 2])),
        r"config\.json: target_layer_ids must be non-negative integers",
        id="negative-target-layer-id",
    ),
    pytest.param(
        lambda p: rewrite_config(p, rms_norm_eps=-1),
        r"config\.json: .*'rms_norm_eps' expected float, got int \(value: -1\)",
        id="eps-int",
    ),
    pytest.param(
        lambda p: rewrite_config(p, rms_norm_eps=-1.0),
        r"config\.json: rms_norm_eps must be a positive float, got -1\.0",
        id="eps-negative",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(mask_token_id="3")),
        r"config\.json: dflash_config\.mask_token_id must be an integer in \[0, vocab_size=96\), got '3'",
        id="mask-token-string",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(mask_token_id=VOCAB)),
        r"config\.json: dflash_config\.mask_token_id must be an integer in \[0, vocab_size=96\), got 96",
        id="mask-token-outside-vocab",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=None),
        r"config\.json: dflash_config\.mask_token_id is missing",
        id="no-dflash-config",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config={"target_layer_ids": [0, 2]}),
        r"config\.json: dflash_config\.mask_token_id is missing",
        id="no-mask-token",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, acceptance_calibration="oops"),
        r"config\.json: dmtp_config\.acceptance_calibration must be a dict with 'edges', 'rates' and 'base_rates'",
        id="calibration-string",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, acceptance_calibration={"rates": [[0.5]]}),
        r"config\.json: dmtp_config\.acceptance_calibration is missing \['edges'\]",
        id="calibration-no-edges",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, acceptance_calibration={**CALIBRATION, "rates": [[0.2, 0.9], [0.1]]}),
        r"config\.json: dmtp_config\.acceptance_calibration\.rates must be a list .* of 2 probabilities",
        id="calibration-ragged-rates",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, acceptance_calibration={**CALIBRATION, "edges": [1.0, 0.5]}),
        r"config\.json: dmtp_config\.acceptance_calibration\.edges must be increasing numbers in \(0, 1\]",
        id="calibration-decreasing-edges",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, acceptance_calibration={**CALIBRATION, "base_rates": "high"}),
        r"config\.json: dmtp_config\.acceptance_calibration\.base_rates must be a list of probabilities",
        id="calibration-base-rates",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, num_candidates=True),
        r"config\.json: num_candidates must be a positive integer, got True",
        id="num-candidates-bool",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, fusion_rank="64"),
        r"config\.json: fusion_rank must be a positive integer, got '64'",
        id="fusion-rank-string",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, mtp_hidden_size=0),
        r"config\.json: mtp_hidden_size must be a positive integer, got 0",
        id="mtp-hidden-size-zero",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, anchor_layout="triple"),
        r"config\.json: Unknown anchor_layout 'triple'",
        id="anchor-layout-unknown",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, mtp_hidden_input="middle"),
        r"config\.json: Unknown mtp_hidden_input 'middle'",
        id="mtp-hidden-input-unknown",
    ),
    # 3b. every other field against its meaning (issue #62, item 4): each of these loaded, or failed far from the file
    *[
        pytest.param(
            lambda p, block=block: rewrite_config(p, block_size=block),
            rf"config\.json: block_size must be an integer >= 2, got {re.escape(repr(block))}\.",
            id=f"zlab-block-size-{block}",
        )
        for block in (0, 1, -3, 2.5, True, "16")
    ],
    pytest.param(
        lambda p: rewrite_config(p, block_size=None, dflash_config=dflash_config(block_size=0)),
        r"config\.json: block_size must be an integer >= 2, got 0\.",
        id="zlab-nested-block-size-0",
    ),
    pytest.param(
        lambda p: rewrite_config(p, block_size=10**6),  # the first generate tried to allocate 1 TB
        r"config\.json: block_size must be at most 256 \(min\(256, max_position_embeddings\).*got 1000000\.",
        id="zlab-block-size-huge",
    ),
    pytest.param(
        lambda p: rewrite_config(p, block_size=64, max_position_embeddings=32),
        r"config\.json: block_size must be at most 32 .*got 64\.",
        id="block-size-beyond-positions",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, num_candidates=10**6),
        r"config\.json: num_candidates must be at most 255 \(a block holds at most 256 slots\), got 1000000\.",
        id="num-candidates-huge",
    ),
    pytest.param(
        lambda p: rewrite_config(p, rope_theta=-1),
        r"config\.json: rope_theta must be a finite number in \(0, inf\), got -1\.",
        id="rope-theta-negative",
    ),
    pytest.param(
        lambda p: rewrite_config(p, rope_theta=None, rope_parameters={"rope_type": "banana", "rope_theta": 1e4}),
        r"config\.json: Unknown rope_type 'banana'; expected one of \['default', ",
        id="rope-type-unknown",
    ),
    *[
        pytest.param(
            lambda p, window=window: rewrite_config(p, sliding_window=window, use_sliding_window=window == 0),
            rf"config\.json: sliding_window must be a positive integer, got {window}\.",
            id=f"sliding-window-{window}",
        )
        for window in (0, -5)
    ],
    pytest.param(
        lambda p: rewrite_config(p, draft_vocab_size=10**6),
        r"config\.json: draft_vocab_size must be at most 96 \(a subset of the vocabulary: vocab_size\), got 1000000",
        id="draft-vocab-larger-than-vocab",
    ),
    pytest.param(
        lambda p: rewrite_config(p, draft_vocab_size=True),
        r"config\.json: draft_vocab_size must be a positive integer, got True\.",
        id="draft-vocab-bool",
    ),
    pytest.param(
        lambda p: rewrite_config(p, is_causal="yes"),
        r"config\.json: is_causal must be true, false or null \(unset\), got 'yes'\.",
        id="is-causal-string",
    ),
    pytest.param(
        lambda p: rewrite_config(p, backbone="banana"),
        r"config\.json: Unknown backbone 'banana'; expected one of \('dflash', 'dflash2'\)",
        id="backbone-unknown",
    ),
    pytest.param(
        lambda p: rewrite_config(p, hidden_act="banana"),  # was `KeyError: 'banana'` while building the MLP
        r"config\.json: Unknown hidden_act 'banana'; expected one of \[.*'silu'.*\] \(the activations of transf",
        id="activation-unknown",
    ),
    pytest.param(
        lambda p: rewrite_config(p, num_key_value_heads=0),  # was a ZeroDivisionError
        r"config\.json: num_key_value_heads must be a positive integer, got 0\.",
        id="kv-heads-zero",
    ),
    pytest.param(
        lambda p: rewrite_config(p, num_key_value_heads=3),
        r"config\.json: num_key_value_heads=3 does not divide num_attention_heads=4",
        id="kv-heads-not-dividing",
    ),
    pytest.param(
        lambda p: rewrite_config(p, head_dim=0),  # loaded (read as unset)
        r"config\.json: head_dim must be a positive integer, got 0\.",
        id="head-dim-zero",
    ),
    pytest.param(
        lambda p: rewrite_config(p, max_position_embeddings=0),
        r"config\.json: max_position_embeddings must be a positive integer, got 0\.",
        id="max-positions-zero",
    ),
    pytest.param(
        lambda p: rewrite_config(p, num_target_layers="4"),  # was a TypeError comparing with target_layer_ids
        r"config\.json: num_target_layers must be a positive integer, got '4'\.",
        id="num-target-layers-string",
    ),
    pytest.param(
        lambda p: rewrite_config(p, attention_dropout=2.0),
        r"config\.json: attention_dropout must be a finite number in \[0, 1\), got 2\.0\.",
        id="dropout-above-one",
    ),
    pytest.param(
        lambda p: rewrite_config(p, initializer_range=-1.0),
        r"config\.json: initializer_range must be a finite number in \[0, inf\), got -1\.0\.",
        id="initializer-range-negative",
    ),
    pytest.param(
        lambda p: rewrite_config(p, max_window_layers=-1),
        r"config\.json: max_window_layers must be an integer >= 0, got -1\.",
        id="max-window-layers-negative",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dtype="banana"),  # was `AttributeError: module 'torch' has no attribute`
        r"config\.json: Unknown dtype 'banana'; expected one of \[.*'bfloat16'.*\] \(a floating-point torch dtype\)",
        id="dtype-unknown",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(output_multiplier="2")),
        r"config\.json: dflash_config\.output_multiplier must be a finite number in \(0, inf\), got '2'\.",
        id="output-multiplier-string",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(final_logit_softcapping=-30.0)),
        r"config\.json: dflash_config\.final_logit_softcapping must be a finite number in \[0, inf\), got -30\.0",
        id="softcapping-negative",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(**{**DFLASH2, "conv_kernel_size": True})),
        r"config\.json: DFlash2 needs positive integers for conv_kernel_size=True \(dflash_config\)",
        id="dflash2-kernel-bool",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config=dflash_config(**{**DFLASH2, "conv_kernel_size": 10**6})),
        r"config\.json: dflash_config\.conv_kernel_size must be at most 16 \(taps past the block's 16 slots",
        id="dflash2-kernel-huge",
    ),
    pytest.param(
        lambda p: rewrite_config(
            p, dflash_config=dflash_config(**{**DFLASH2, "selector_rank": 10**9})
        ),  # 384 GB codebooks
        r"config\.json: dflash_config\.selector_rank must be at most 131072, got 1000000000\.",
        id="dflash2-rank-huge",
    ),
    # 4. misspelt fields (Transformers would keep them as attributes that nothing reads)
    pytest.param(
        lambda p: rewrite_config(p, num_candidate=6),
        r"config\.json: Unknown config key 'num_candidate': did you mean 'num_candidates'\?",
        id="typo-top-level",
    ),
    pytest.param(
        lambda p: rewrite_config(p, anchor_layuot="dual"),
        r"config\.json: Unknown config key 'anchor_layuot': did you mean 'anchor_layout'\?",
        id="typo-top-level-layout",
    ),
    pytest.param(
        lambda p: dmtp_layout(p, num_candidate=6),
        r"config\.json: Unknown dmtp_config key 'num_candidate': did you mean 'num_candidates'\?",
        id="typo-dmtp-config",
    ),
    pytest.param(
        lambda p: rewrite_config(p, dflash_config={**dflash_config(), "target_layer_id": [0, 2]}),
        r"config\.json: Unknown dflash_config key 'target_layer_id': did you mean 'target_layer_ids'\?",
        id="typo-dflash-config",
    ),
]


@pytest.mark.parametrize("break_it, match", CASES)
def test_a_broken_checkpoint_is_refused_at_load_naming_the_file_and_the_field(tmp_path, break_it, match):
    write_dflash_checkpoint(tmp_path, num_layers=2)
    break_it(tmp_path)
    with pytest.raises(ValueError, match=match) as refused:
        DMTPDraftModel.from_pretrained(tmp_path)
    assert str(tmp_path) in str(refused.value)  # the checkpoint is named, not only the field


def test_sound_variants_of_those_checkpoints_still_load(tmp_path):
    # sharded, stored in bf16 for an fp32 model (a float-to-float cast is fine), DMTP layout with a calibration
    tensors = write_dflash_checkpoint(tmp_path, num_layers=2)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    shard(tmp_path)
    dmtp_layout(tmp_path, acceptance_calibration=CALIBRATION)
    draft = DMTPDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert draft.fc.weight.dtype == torch.float32
    assert torch.equal(draft.fc.weight, tensors["fc.weight"].to(torch.bfloat16).float())
    assert draft.config.dmtp_config["acceptance_calibration"] == CALIBRATION


def test_in_memory_configs_get_the_same_field_checks():
    with pytest.raises(ValueError, match=r"target_layer_ids must be non-negative integers \(not booleans\)"):
        tiny_draft_config(target_layer_ids=[True, 3])
    with pytest.raises(ValueError, match=r"dflash_config\.mask_token_id must be an integer"):
        tiny_draft_config(mask_token_id="3")
    with pytest.raises(ValueError, match="rms_norm_eps must be a positive float"):
        tiny_draft_config(rms_norm_eps=-1.0)
    with pytest.raises(ValueError, match="acceptance_calibration must be a dict"):
        tiny_draft_config(dmtp_config={"acceptance_calibration": ["oops"]})


def test_every_calibration_dmtp_calibrate_writes_passes():
    pairs = [(position, conf / 10, conf > 3 + position) for position in range(3) for conf in range(10)]
    for calibration in (Calibration.fit(pairs), Calibration.fit([]), Calibration()):
        check_acceptance_calibration(calibration.to_dict())
        check_acceptance_calibration(json.loads(json.dumps(calibration.to_dict())))  # as read back from config.json
    bundled = [p.parent for p in dmtp_hf.bundled.MODELS_DIR.rglob("config.json")]
    calibrated = [p for p in bundled if "acceptance_calibration" in (p / "config.json").read_text()]
    assert calibrated  # the bundled drafts carry fits, older ones without base rates
    for folder in calibrated:
        assert DMTPConfig.from_pretrained(folder).dmtp_config["acceptance_calibration"]["rates"]


# ----------------------------------------------------------------------------------------------------
# 2. Stored copies of the target's embedding / LM head


def write_with_copies(path: Path, target, embed: torch.Tensor | None = None, head: torch.Tensor | None = None) -> None:
    """A DFlash checkpoint carrying ``embed_tokens.weight`` / ``lm_head.weight`` (default: the target's own)."""
    write_dflash_checkpoint(path, num_layers=2)
    tensors = load_file(path / "model.safetensors")
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone() if embed is None else embed
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone() if head is None else head
    save_file(tensors, str(path / "model.safetensors"))


def ignored_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "which the draft ignores" in str(w.message)]


def test_copies_of_the_target_tensors_load_with_that_target(tmp_path, target):
    # as z-lab previews ship them; a bf16 copy of an fp32 target head is the same weights within bf16 rounding
    write_with_copies(tmp_path, target, head=target.get_output_embeddings().weight.detach().to(torch.bfloat16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        draft = DMTPDraftModel.from_pretrained(tmp_path, target=target)
    assert draft.target is target and not ignored_warnings(caught)


@pytest.mark.parametrize("name, what", [("embed_tokens.weight", "input embedding"), ("lm_head.weight", "LM head")])
def test_copies_that_are_not_the_target_tensors_are_refused(tmp_path, target, name, what):
    own = (target.get_input_embeddings() if name == "embed_tokens.weight" else target.get_output_embeddings()).weight
    other = own.detach() + 0.01 * torch.randn_like(own)  # another target's (a fine-tune of the same base, say)
    write_with_copies(tmp_path, target, **{"embed" if name == "embed_tokens.weight" else "head": other})
    with pytest.raises(ValueError, match=rf"model\.safetensors: '{re.escape(name)}' .* is not the target's {what}"):
        DMTPDraftModel.from_pretrained(tmp_path, target=target)


def test_copies_loaded_without_a_target_are_named_in_a_warning(tmp_path, target):
    write_with_copies(tmp_path, target, head=torch.randn(VOCAB, target.config.hidden_size))
    with pytest.warns(UserWarning, match=r"\['embed_tokens\.weight', 'lm_head\.weight'\], which the draft ignores"):
        DMTPDraftModel.from_pretrained(tmp_path)


def test_a_draft_vocabulary_lm_head_is_left_alone(tmp_path, target):
    # its `lm_head.weight` is the target head's subset rows (engines read it from the draft folder): not a copy
    draft = draft_for(target, draft_vocab_size=VOCAB // 4, anchor_layout="dflash", fusion="none")
    set_draft_vocabulary(draft, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[: VOCAB // 4])
    draft.save_dflash(tmp_path)
    assert load_file(tmp_path / "model.safetensors")["lm_head.weight"].shape[0] == VOCAB // 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = DMTPDraftModel.from_pretrained(tmp_path, target=target)
        DMTPDraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.d2t, draft.d2t) and not ignored_warnings(caught)


# ----------------------------------------------------------------------------------------------------
# 3. What a newcomer gets wrong first: the folder, a key's spelling, a head for a target that ships none


@pytest.mark.parametrize("load", [DMTPDraftModel.from_pretrained, DMTPConfig.from_pretrained])
def test_a_folder_without_config_json_says_so_and_what_a_draft_folder_holds(tmp_path, load):
    write_dflash_checkpoint(tmp_path / "weights", num_layers=2)
    (tmp_path / "weights" / "config.json").unlink()
    expected = (
        rf"No config\.json in {re.escape(str(tmp_path / 'weights'))}: a DMTP or DFlash draft folder holds config\.json "
        r".* next to model\.safetensors .* This folder holds model\.safetensors\.$"
    )
    with pytest.raises(FileNotFoundError, match=expected):
        load(tmp_path / "weights")
    # a training run's output_dir: the draft is one level down
    write_dflash_checkpoint(tmp_path / "run" / "final", num_layers=2)
    with pytest.raises(FileNotFoundError, match=rf"This folder holds final/\. Did you mean {re.escape(str(tmp_path))}"):
        load(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=r"It is empty\."):
        load((tmp_path / "empty").mkdir() or tmp_path / "empty")


@pytest.mark.parametrize("load", [DMTPDraftModel.from_pretrained, DMTPConfig.from_pretrained])
def test_a_path_that_does_not_exist_is_refused_as_such(tmp_path, load):
    with pytest.raises(FileNotFoundError, match=r"No checkpoint directory at '.*nowhere'\.$"):
        load(tmp_path / "nowhere")
    # a bare name reads as a Hub repo id; neither a folder nor a readable repo, it says both
    with pytest.raises(FileNotFoundError, match=r"No checkpoint directory at 'no-such-draft', and no Hub repo of that"):
        load("no-such-draft", local_files_only=True)


def test_misspelt_keyword_overrides_are_refused_with_the_field_they_resemble(tmp_path):
    write_dflash_checkpoint(tmp_path, num_layers=2)
    hint = r"Unknown keyword argument 'num_candidate': did you mean 'num_candidates'\?"
    with pytest.raises(ValueError, match=hint):
        DMTPDraftModel.from_pretrained(tmp_path, num_candidate=6)
    with pytest.raises(ValueError, match=hint):
        DMTPConfig.from_pretrained(tmp_path, num_candidate=6)
    with pytest.raises(ValueError, match=r"'anchor_layuot': did you mean 'anchor_layout'\?"):
        DMTPDraftModel.from_pretrained(tmp_path, config=DMTPConfig.from_pretrained(tmp_path), anchor_layuot="dual")
    with pytest.raises(ValueError, match=r"Unknown config key 'fusion_rnak': did you mean 'fusion_rank'\?"):
        tiny_draft_config(fusion_rnak=8)


def test_keys_that_resemble_no_field_still_load(tmp_path):
    # what DFlash configs, tokenizers and engines add (special-token ids are close to mask_token_id, not misspelt)
    write_dflash_checkpoint(tmp_path, num_layers=2)
    extras = {"sep_token_id": 3, "image_token_id": 4, "rope_theta": 10000.0, "engine_hint": "x"}
    rewrite_config(tmp_path, **extras, dflash_config=dflash_config(output_multiplier=1.0, engine_extra=2))
    config = DMTPDraftModel.from_pretrained(tmp_path, anchor_layout="dual", num_candidates=7).config
    assert config.engine_hint == "x" and config.dflash_config["engine_extra"] == 2
    assert (config.anchor_layout, config.num_candidates) == ("dual", 7)


def test_a_draft_that_needs_a_head_is_refused_at_load_on_a_target_without_one(tmp_path, target):
    """A Qwen3 target ships no MTP head: a DMTP draft on it fails at load, naming the target and the ways out,
    instead of in the first `generate`; with a head passed, or in the DFlash layout, it loads."""
    draft = DMTPDraftModel(tiny_draft_config())
    draft.save_pretrained(tmp_path / "dmtp")
    expected = (
        r"dmtp: this draft \(anchor_layout='dual'\) drafts after the first candidate of an MTP head, but the target "
        r"Qwen3ForCausalLM \(model_type 'qwen3'\) has no native MTP head .*Either pass a trained head: "
        r"DMTPDraftModel\.from_pretrained\(path, target=target, native_mtp=load_native_mtp\(target, "
        r"checkpoint=HEAD_DIR\)\) .*or use a DFlash draft \(anchor_layout='dflash'\), which needs no head\.$"
    )
    with pytest.raises(ValueError, match=expected):
        DMTPDraftModel.from_pretrained(tmp_path / "dmtp", target=target)
    head = new_mtp_head(target)  # stands in for a trained retrofitted head
    loaded = DMTPDraftModel.from_pretrained(tmp_path / "dmtp", target=target, native_mtp=head)
    assert loaded.native_mtp is head and loaded.target is target
    with pytest.raises(ValueError, match="pass target= too"):
        DMTPDraftModel.from_pretrained(tmp_path / "dmtp", native_mtp=head)

    # a draft trained on a retrofitted head asks for that head
    retrofit = DMTPDraftModel(tiny_draft_config(dmtp_config={"mtp_source": "retrofit"}))
    retrofit.save_pretrained(tmp_path / "retrofit")
    with pytest.raises(ValueError, match="Either pass that retrofitted head: "):
        DMTPDraftModel.from_pretrained(tmp_path / "retrofit", target=target)

    # a DFlash checkpoint needs no head; asked for as DMTP, the message says to load it as what it is
    write_dflash_checkpoint(tmp_path / "dflash", num_layers=2)
    assert DMTPDraftModel.from_pretrained(tmp_path / "dflash", target=target).config.anchor_layout == "dflash"
    with pytest.raises(ValueError, match=r"or load it without anchor_layout= \(or anchor_layout='dflash'\)"):
        DMTPDraftModel.from_pretrained(tmp_path / "dflash", target=target, anchor_layout="dual")
