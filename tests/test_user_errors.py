"""Mistakes a user makes first, answered with what to do (issue #62, item 8): a mistyped local folder is reported
before any Hub call, an unbound draft given to a hybrid target's ``generate`` says to bind it, and a draft trained
for one target warns when it is bound to another of the same sizes."""

import warnings

import pytest
import torch
from conftest import VOCAB, draft_for, tiny_qwen3_target
from transformers import Qwen3Config, Qwen3ForCausalLM

import dmtp_hf
from dmtp_hf import DMTPDraftModel
from dmtp_hf.assistant.target.loading import load_target
from dmtp_hf.cli import main
from dmtp_hf.local_paths import looks_local, require_local_folder
from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target

# ----------------------------------------------------------------------------------------------------
# A mistyped local folder: no Hub call, a message about the folder


def test_what_can_only_be_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for local in ("./runs/final", "../draft", "/abs/draft", "~/draft", "runs/my-dmtp/final", tmp_path / "x"):
        assert looks_local(local), local
    for hub_id in ("Qwen/Qwen3-8B", "bundled", "gpt2"):
        assert not looks_local(hub_id), hub_id
    (tmp_path / "runs").mkdir()
    assert looks_local("runs/my-dmtp")  # its parent folder exists here: a typo of a local folder, not a Hub id
    require_local_folder("Qwen/Qwen3-8B")  # Hub ids are left to Transformers
    require_local_folder(tmp_path / "runs")
    with pytest.raises(FileNotFoundError, match=r"No --target folder at 'runs/my-dmtp' \(the nearest existing"):
        require_local_folder("runs/my-dmtp", "--target")
    # the same text is a valid Hub id: the message says why it was read as local, and how to reach the Hub repo
    with pytest.raises(FileNotFoundError, match=r"because a folder 'runs' exists in the current directory \(to load"):
        require_local_folder("runs/my-dmtp")
    with pytest.raises(FileNotFoundError, match=r"It can only be a local path"):
        require_local_folder("./runs/my-dmtp")


@pytest.fixture(autouse=True)
def _keep_threads():
    """`dmtp bench` sets torch's threads before it checks its paths: give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything reaches for a model by name (a Hub lookup) instead of refusing the path first."""
    import transformers

    def asked(*args, **kwargs):
        raise AssertionError(f"a model was looked up: {args[:1]}")

    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", asked)


def test_the_library_loader_reports_a_missing_local_target_folder(no_hub):
    with pytest.raises(FileNotFoundError, match=r"No target checkpoint folder at '\./runs/mistyped'.*Hub was not"):
        load_target("./runs/mistyped")


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--target", "./runs/mistyped", "--no-progress"],
        ["bench", "--target", "./runs/mistyped", "--threads", "1", "--no-progress"],
        ["calibrate", "--target", "./runs/mistyped"],
        ["eval", "--draft", "./runs/mistyped@native", "--no-progress"],
        ["regenerate", "--target", "./runs/mistyped", "--input", "in.jsonl", "--output", "out.jsonl"],
        ["extract", "--target", "./runs/mistyped", "--data", "d.jsonl", "--output", "o", "--target-layer-ids", "0"],
        ["convert", "./runs/mistyped", "out"],
        ["info", "./runs/mistyped"],
    ],
)
def test_every_command_reports_a_missing_local_folder_before_loading_anything(argv, capsys, no_hub):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "runs/mistyped'" in err and "Hub was not asked" in err, err


def test_training_reports_a_missing_local_target_before_loading_it(tmp_path, capsys, no_hub):
    config = tmp_path / "run.yaml"
    config.write_text("target_model: ./runs/mistyped\ntrain_data: synthetic:4x16\noutput_dir: out\n")
    assert main(["train", "--config", str(config)]) == 2
    assert "No target_model folder at './runs/mistyped'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# An unbound draft


def test_an_unbound_draft_on_a_hybrid_target_says_to_bind_it(tmp_path):
    """Transformers refuses assisted decoding on a stateful target before it reads the assistant ("not supported
    with stateful models"); the fix is to bind the draft, and the error now says so."""
    path = make_tiny_target("qwen3_5", tmp_path / "target")
    target = load_tiny_target(path)  # never bound: its generate is Transformers' own
    assert target._is_stateful and not hasattr(target, "_dmtp_original_generate")
    unbound = DMTPDraftModel(draft_for(load_tiny_target(path), anchor_layout="dflash").config)
    prompt = torch.tensor([[5, 17, 42, 9]])
    bind = r"bind it to its target \(DMTPDraftModel\.from_pretrained\(path, target=target\) or draft\.bind\(target\)\)"
    with pytest.raises(ValueError, match=bind):
        target.generate(prompt, assistant_model=unbound, max_new_tokens=4)
    with pytest.raises(ValueError, match=bind):  # the library's own entry point, which said "no MTP head bound"
        dmtp_hf.generate(target, prompt, unbound, max_new_tokens=4)
    # everything else still reaches Transformers as before
    with pytest.raises(ValueError, match="not supported with stateful models"):
        target.generate(prompt, assistant_model=load_tiny_target(path), max_new_tokens=4)
    assert target.generate(prompt, max_new_tokens=2, do_sample=False).shape == (1, 6)


# ----------------------------------------------------------------------------------------------------
# A draft trained for another target


def same_sizes_other_target() -> Qwen3ForCausalLM:
    """A target with the sizes of `tiny_qwen3_target` but another architecture config (its RoPE base)."""
    reference = tiny_qwen3_target().config.to_dict()
    reference["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    return Qwen3ForCausalLM(Qwen3Config(**reference)).eval()


def test_a_trained_draft_warns_when_bound_to_another_target_of_the_same_sizes(tmp_path):
    from test_training import make_config

    from dmtp_hf.training import build_draft

    target = tiny_qwen3_target()
    config = make_config(tmp_path, anchor_layout="dflash", fusion="none", draft_config={"mask_token_id": VOCAB - 1})
    trained = build_draft(config, target)  # what the trainer trains and saves
    recorded = trained.config.dmtp_config["target_identity"]
    assert recorded["model_type"] == "qwen3" and len(recorded["config_sha256"]) == 64
    trained.save_pretrained(tmp_path / "draft")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DMTPDraftModel.from_pretrained(tmp_path / "draft", target=tiny_qwen3_target())  # its own kind: quiet
        draft_for(same_sizes_other_target(), anchor_layout="dflash")  # a draft without the record: quiet
    assert not [w for w in caught if "trained for" in str(w.message)]
    with pytest.warns(UserWarning, match=r"This draft was trained for .*another architecture config"):
        DMTPDraftModel.from_pretrained(tmp_path / "draft", target=same_sizes_other_target())
