"""`dmtp_vllm.checks`: draft folders vLLM would fail on late are refused by name, from JSON and safetensors headers
alone (no engine, no weights: these tests start no vLLM and need no target on disk)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from dmtp_vllm.checks import DraftFolderError, check_draft, check_safetensors_file

TARGET_CONFIG = {"model_type": "llama", "hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30}
DRAFT_CONFIG = {  # the fields of a SmolLM2 DMTP draft exported with `dmtp convert --to vllm`
    "architectures": ["DFlashDMTPDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 576,
    "vocab_size": 49152,
    "num_target_layers": 30,
    "dflash_config": {"block_size": 16, "mask_token_id": 16, "target_layer_ids": [1, 14, 27]},
    "eagle_aux_hidden_state_layer_ids": [2, 15, 28, 30],
    "dmtp_config": {"anchor_layout": "dual", "mtp_hidden_size": 576},
}


def write_safetensors(path: Path, data_bytes: int = 16, header_extra: dict | None = None) -> None:
    """A minimal safetensors file: one float32 tensor of ``data_bytes`` bytes."""
    header = {"fc.weight": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}}
    header.update(header_extra or {})
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data_bytes))


def write_folder(folder: Path, config: dict) -> Path:
    """A model folder: ``config`` as config.json and one whole safetensors file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors")
    return folder


@pytest.fixture
def fake_target(tmp_path) -> Path:
    """A target folder with only the config the checks read (the SmolLM2 target's sizes)."""
    return write_folder(tmp_path / "target", TARGET_CONFIG)


def test_a_converted_draft_for_its_target_passes(tmp_path, fake_target):
    """A vLLM export of a SmolLM2 draft, next to SmolLM2's config: nothing to refuse."""
    check_draft(write_folder(tmp_path / "draft", DRAFT_CONFIG), fake_target)


def test_an_unconverted_dmtp_folder_is_told_the_convert_command(tmp_path, fake_target):
    """dmtp-hf's own format: the exact `dmtp convert` command, with both folders."""
    draft = write_folder(tmp_path / "dmtp", {**DRAFT_CONFIG, "model_type": "dmtp"})
    with pytest.raises(DraftFolderError, match=r"not converted for vLLM") as error:
        check_draft(draft, fake_target)
    assert f"dmtp convert {draft} {draft}-vllm --to vllm --target {fake_target}" in str(error.value)


def test_an_unconverted_dflash_folder_is_told_to_export_as_dflash(tmp_path, fake_target):
    """A DFlash-layout draft in dmtp-hf's format is pointed to `--to dflash` (`--to vllm` refuses it)."""
    config = {**DRAFT_CONFIG, "model_type": "dmtp", "dmtp_config": {"anchor_layout": "dflash"}}
    draft = write_folder(tmp_path / "dflash", config)
    with pytest.raises(DraftFolderError, match=r"--to dflash"):
        check_draft(draft, fake_target)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_size", 2048, "hidden_size: the draft's is 2048, the target's 576"),
        ("vocab_size", 151936, "vocab_size: the draft's is 151936, the target's 49152"),
        ("num_target_layers", 36, "num_target_layers: the draft's is 36, the target has 30"),
        ("dflash_config", {"target_layer_ids": [1, 17, 33]}, "[33] outside the target's 30 layers"),
        ("eagle_aux_hidden_state_layer_ids", [2, 18, 34, 36], "[34, 36] beyond the target's 30 layers"),
        ("dmtp_config", {"mtp_hidden_size": 1024}, "mtp_hidden_size: the draft's is 1024"),
    ],
)
def test_a_draft_for_another_target_names_both_models_and_the_field(tmp_path, fake_target, field, value, named):
    """Each field that ties a draft to its target, changed alone, is refused with both folders named."""
    draft = write_folder(tmp_path / "draft", {**DRAFT_CONFIG, field: value})
    with pytest.raises(DraftFolderError) as error:
        check_draft(draft, fake_target)
    message = str(error.value)
    assert named in message and str(draft) in message and str(fake_target) in message


def test_a_multimodal_target_is_compared_through_its_text_config(tmp_path):
    """Qwen3.5-style configs keep the language model's sizes under `text_config`."""
    target = write_folder(tmp_path / "vl", {"model_type": "qwen3_5", "text_config": TARGET_CONFIG})
    check_draft(write_folder(tmp_path / "draft", DRAFT_CONFIG), target)


def test_a_target_given_as_a_config_needs_no_folder(tmp_path):
    """A Hub target is checked against the config vLLM already read, named by its id."""
    draft = write_folder(tmp_path / "draft", DRAFT_CONFIG)
    check_draft(draft, "org/some-hub-id", target_config=TARGET_CONFIG)
    with pytest.raises(DraftFolderError, match="org/other-hub-id"):
        check_draft(draft, "org/other-hub-id", target_config={**TARGET_CONFIG, "hidden_size": 896})


@pytest.mark.parametrize("architecture", ["MiMoForCausalLM", "Glm4MoeForCausalLM"])
def test_a_target_whose_vllm_model_captures_no_layers_is_refused_by_name(tmp_path, architecture):
    """vLLM 0.32's MiMo and GLM-4-MoE models hand a DFlash drafter none of the target's layers: the engine would
    fail at its first step or after loading the target; the check says so before either, naming the model."""
    target = write_folder(tmp_path / "target", {**TARGET_CONFIG, "architectures": [architecture]})
    with pytest.raises(DraftFolderError, match=f"{architecture}.*cannot serve a DFlash or DMTP draft.*mtp"):
        check_draft(write_folder(tmp_path / "draft", DRAFT_CONFIG), target)


def test_a_truncated_safetensors_file_is_named(tmp_path, fake_target):
    """Cut in the data or inside the header: the file is named as truncated."""
    draft = write_folder(tmp_path / "draft", DRAFT_CONFIG)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(DraftFolderError, match=r"model\.safetensors is truncated"):
        check_draft(draft, fake_target)
    weights.write_bytes(weights.read_bytes()[:20])  # cut inside the header
    with pytest.raises(DraftFolderError, match=r"model\.safetensors is truncated"):
        check_draft(draft, fake_target)


def test_an_unparsable_or_overlong_safetensors_file_is_named(tmp_path):
    """A header that is not JSON, data past the header's offsets, a file shorter than 8 bytes."""
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(struct.pack("<Q", 5) + b"{nope" + bytes(4))
    with pytest.raises(DraftFolderError, match=r"broken\.safetensors has a safetensors header that cannot be parsed"):
        check_safetensors_file(broken)
    longer = tmp_path / "longer.safetensors"
    write_safetensors(longer)
    longer.write_bytes(longer.read_bytes() + bytes(8))
    with pytest.raises(DraftFolderError, match=r"longer\.safetensors is longer than its header describes"):
        check_safetensors_file(longer)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    with pytest.raises(DraftFolderError, match=r"tiny\.safetensors is not a safetensors file"):
        check_safetensors_file(tiny)


def test_metadata_and_a_sharded_index_are_understood(tmp_path, fake_target):
    """`__metadata__` holds no tensor; a shard the index names must exist."""
    draft = write_folder(tmp_path / "draft", DRAFT_CONFIG)
    (draft / "model.safetensors").unlink()
    write_safetensors(draft / "model-00001-of-00002.safetensors", header_extra={"__metadata__": {"format": "pt"}})
    index = {
        "weight_map": {
            "fc.weight": "model-00001-of-00002.safetensors",
            "norm.weight": "model-00002-of-00002.safetensors",
        }
    }
    (draft / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DraftFolderError, match=r"model-00002-of-00002\.safetensors"):
        check_draft(draft, fake_target)
    write_safetensors(draft / "model-00002-of-00002.safetensors")
    check_draft(draft, fake_target)


def test_a_folder_without_weights_or_config_is_refused(tmp_path, fake_target):
    """No config.json, then no weights: each said."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DraftFolderError, match="has no config.json"):
        check_draft(empty, fake_target)
    (empty / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    with pytest.raises(DraftFolderError, match="holds no .safetensors weights"):
        check_draft(empty, fake_target)


def test_the_exported_drafts_pass_against_their_target(exported, target):
    """The real exports (`conftest.exported`, SmolLM2): nothing in a correct folder is refused."""
    for draft in exported.values():
        check_draft(draft, target)


def test_the_engine_refuses_an_unconverted_folder_before_loading_the_target(target):
    """The hook runs the check where vLLM builds its speculative config: no engine process starts."""
    from conftest import BUNDLE
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(  # its construction loads the plugins, which install the hook
        model=str(target),
        dtype="float32",
        max_model_len=1024,
        speculative_config={"method": "dflash", "model": str(BUNDLE / "dmtp"), "num_speculative_tokens": 7},
    )
    with pytest.raises(DraftFolderError, match="not converted for vLLM"):
        args.create_engine_config()


def test_a_dmtp_draft_runs_on_the_v1_model_runner_whatever_vllm_would_pick(exported, target, monkeypatch):
    """With Triton vLLM 0.32 picks its V2 model runner, where a DMTP folder would run as plain DFlash without a word:
    building the engine's config for a DMTP draft sets VLLM_USE_V2_MODEL_RUNNER=0 (the engine's processes start
    with it), and an explicit request for V2 is refused by name."""
    from vllm.engine.arg_utils import EngineArgs

    from dmtp_vllm.hook import require_v1_model_runner

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # recorded, so that the variable is unset again after
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    spec = {"method": "dflash", "model": str(exported["dmtp"]), "num_speculative_tokens": 7}
    config = EngineArgs(model=str(target), dtype="float32", max_model_len=1024, speculative_config=spec)
    config.create_engine_config()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    with pytest.raises(RuntimeError, match="V1 model runner.*VLLM_USE_V2_MODEL_RUNNER='1'"):
        require_v1_model_runner({"VLLM_USE_V2_MODEL_RUNNER": "1"})
