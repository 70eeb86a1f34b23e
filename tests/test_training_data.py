"""Training data that must be refused or reported by name: ids outside the vocabulary, bytes that are not UTF-8,
records cut by ``max_length``, data changed under a resumed run; and the temporary folders of interrupted
checkpoint writes, removed once a later write succeeds or a run resumes.

Everything runs on the tiny qwen3_5 target (vocab 128) with a couple of training steps at most.
"""

import json
import logging
import re

import pytest
import torch
from test_training import make_config as training_config

from dmtp_hf.assistant.target.loading import load_target
from dmtp_hf.modeling import io
from dmtp_hf.modeling.io import atomic_directory
from dmtp_hf.training import TokenizedDataset, TrainConfig, Trainer, load_dataset_records, read_jsonl
from dmtp_hf.training.data import data_fingerprints, synthetic_greedy_dataset
from dmtp_hf_assets.tiny_targets import make_tiny_target

VOCAB, MASK = 128, 127


pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models are overhead-bound


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(make_tiny_target("qwen3_5", tmp_path_factory.mktemp("tiny") / "qwen3_5"))


def make_config(tmp_path, **overrides) -> TrainConfig:
    """test_training's tiny run: two steps, a checkpoint at the end, resumed automatically."""
    return training_config(tmp_path, **{"max_steps": 2, "save_every": 2, "resume_from": "auto", **overrides})


def write_records(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def random_records(num: int, length: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB - 1, (length,), generator=g).tolist()} for _ in range(num)]


def interrupted_write(final):
    """What a killed `atomic_directory` write leaves behind: its temporary folder, the cleanup never having run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(io.shutil, "rmtree", lambda *args, **kwargs: None)
        with pytest.raises(KeyboardInterrupt), atomic_directory(final) as tmp:
            (tmp / "model.safetensors").write_bytes(b"\0" * 64)
            raise KeyboardInterrupt
    assert tmp.is_dir() and tmp.name.startswith(f".{final.name}.tmp-")
    return tmp


def test_ids_outside_the_vocabulary_are_refused_by_file_and_line(tmp_path, target):
    path = tmp_path / "data.jsonl"
    write_records(path, [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, VOCAB, 7]}])
    with pytest.raises(ValueError, match=r"data\.jsonl:2: token id 128 \(position 2 .*vocabulary size 128"):
        load_dataset_records(path, vocab_size=VOCAB)
    write_records(path, [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6]}, {"input_ids": [7, -1, 8]}])
    with pytest.raises(ValueError, match=r"data\.jsonl:3: token id -1 \(position 1 .*vocabulary size 128"):
        load_dataset_records(path, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"data\.jsonl:3: token id -1 .* is negative"):
        load_dataset_records(path)  # no vocabulary known: negative ids are still wrong
    # the trainer passes the target's vocabulary size: refused when the data loads, before any step
    write_records(path, [*random_records(3, 24), {"input_ids": [1, 2, 300, 4]}])
    with pytest.raises(ValueError, match=r"data\.jsonl:4: token id 300 .*vocabulary size 128"):
        Trainer(make_config(tmp_path, train_data=str(path)), target=target)


@pytest.mark.parametrize("ids", [[True, False, True, 5], [1, 2.0, 3], [1, "2", 3]], ids=["bools", "float", "string"])
def test_token_ids_that_are_not_integers_are_refused_by_file_and_line(tmp_path, ids):
    # JSON `true`/`false` are Python ints: they trained as ids 1 and 0 (issue #62, item 5)
    path = tmp_path / "data.jsonl"
    write_records(path, [{"input_ids": [1, 2, 3, 4]}, {"input_ids": ids}])
    with pytest.raises(ValueError, match=r"data\.jsonl:2: 'input_ids' must be a list of integers \(not booleans"):
        load_dataset_records(path, vocab_size=VOCAB)


@pytest.mark.parametrize("spec", ["synthetic:0x64", "synthetic:4x1", "synthetic:4x9", "synthetic:ax16", "synthetic:4"])
def test_synthetic_data_specs_that_leave_nothing_to_train_on_are_refused_naming_the_spec(tmp_path, spec):
    # `synthetic:0x64` died in a reshape, `synthetic:4x1` in generate ("max_new_tokens ... is -7"): now the config
    # refuses them before any model loads, naming the spec and what is valid, alone or in a mixture
    expected = rf"{{key}} '{re.escape(spec)}': expected synthetic:<N>x<len> with N >= 1 samples and len >= 10 tokens"
    with pytest.raises(ValueError, match=expected.format(key="train_data")):
        TrainConfig.from_dict({"target_model": "bundled", "train_data": spec, "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=expected.format(key="train_data")):
        TrainConfig.from_dict({"target_model": "bundled", "train_data": [f"{spec}*0.5"], "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=expected.format(key="eval_data")):
        TrainConfig.from_dict(
            {"target_model": "bundled", "train_data": "synthetic:4x16", "eval_data": spec, "output_dir": str(tmp_path)}
        )


def test_synthetic_datasets_too_small_to_train_on_are_refused_when_built_directly():
    with pytest.raises(ValueError, match=r"data source 'synthetic:0x64': expected synthetic:<N>x<len> with N >= 1"):
        synthetic_greedy_dataset(None, 0, 64)
    with pytest.raises(ValueError, match=r"'synthetic:4x5': .* len >= 6 tokens .* random prompt of 4 tokens"):
        synthetic_greedy_dataset(None, 4, 5, prompt_length=4)


def test_bytes_that_are_not_utf8_are_refused_by_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"input_ids": list(range(1, 40))}).encode() + b"\n"
    # past the text decoder's first buffered chunk, whose error offset says nothing about the line
    path.write_bytes(good * 500 + b'{"input_ids": [1, 2], "note": "caf\xe9"}\n' + good)
    with pytest.raises(ValueError, match=r"data\.jsonl:501: byte 0xe9 .* not UTF-8; the file must be UTF-8"):
        list(read_jsonl(path))
    path.write_bytes(good + b"{not json\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: invalid JSON"):
        load_dataset_records(path)


def test_records_longer_than_max_length_are_counted(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    answer_past_the_cut = {"input_ids": list(range(1, 51)), "loss_mask": [0] * 40 + [1] * 10}
    records = [
        {"input_ids": list(range(1, 11))},  # 10 tokens, kept whole
        {"input_ids": list(range(1, 41))},  # 40: truncated, 8 tokens lost
        answer_past_the_cut,  # 50: truncated to an unsupervised prompt, dropped: all 50 lost
        {"input_ids": list(range(1, 21))},  # 20, kept whole
    ]
    write_records(path, records)
    with caplog.at_level(logging.WARNING):
        data = load_dataset_records(path, max_length=32, vocab_size=VOCAB)
    assert len(data) == 3 and max(len(s["input_ids"]) for s in data) == 32
    (warning,) = [r.getMessage() for r in caplog.records if "max_length" in r.getMessage()]
    assert "data.jsonl: 2 of 4 records are longer than max_length=32" in warning
    assert "(48.3% of the tokens lost)" in warning  # (8 + 50) / 120
    assert "1 of them kept no two consecutive supervised tokens and were dropped" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_dataset_records(path, max_length=64)
    assert not [r for r in caplog.records if "max_length" in r.getMessage()]


def test_resuming_on_changed_data_is_refused_unless_allowed(tmp_path, target, caplog):
    path = tmp_path / "data.jsonl"
    write_records(path, random_records(8, 24))
    # a mixture fingerprints its path; a synthetic source has no file to fingerprint
    assert list(data_fingerprints([f"{path}*0.5", "synthetic:4x16"])) == [str(path)]
    mixture = [f"{path}*1.0"]
    Trainer(make_config(tmp_path, train_data=mixture), target=target).train()
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["data_fingerprints"] == data_fingerprints(str(path))
    assert state["data_fingerprints"][str(path)].startswith("sha256:")

    Trainer(make_config(tmp_path, train_data=mixture), target=target).train()  # same data: resumes
    write_records(path, random_records(8, 24, seed=1))
    with pytest.raises(ValueError, match=r"training data changed .*data\.jsonl.*allow_config_change"):
        Trainer(make_config(tmp_path, train_data=mixture), target=target).train()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(make_config(tmp_path, train_data=mixture, allow_config_change=True), target=target)
        trainer.train()
    assert trainer.step == 2
    assert any("training data changed" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_stale_temporary_checkpoint_folders_go_after_a_save_and_on_resume(tmp_path, target):
    root = tmp_path / "run" / "checkpoints"
    data = TokenizedDataset([{"input_ids": torch.tensor(r["input_ids"])} for r in random_records(8, 24)])
    for sample in data.samples:
        sample["loss_mask"] = torch.ones_like(sample["input_ids"])
    stale = interrupted_write(root / "step-00000001")
    partial = root / ".step-00000001.partial"  # accelerate's state, written before the atomic move
    keep = [root / ".step-00000001.old-123", root / ".step-x.tmp-folder"]
    for folder in [partial, *keep]:
        folder.mkdir()
    (root / "notes.txt").write_text("mine")
    Trainer(make_config(tmp_path, resume_from=None), target=target, train_dataset=data).train()
    assert not stale.exists() and not partial.exists()
    assert all(folder.is_dir() for folder in keep) and (root / "notes.txt").read_text() == "mine"
    assert (root / "step-00000002" / "trainer_state.json").is_file()

    stale = interrupted_write(root / "step-00000004")
    trainer = Trainer(make_config(tmp_path), target=target, train_dataset=data)
    trainer.train()  # resumes at step 2 = max_steps: no checkpoint written, the resume removed it
    assert trainer.step == 2 and not stale.exists()
    assert sorted(p.name for p in root.glob("step-0*")) == ["step-00000002"]
    assert all(folder.is_dir() for folder in keep)
