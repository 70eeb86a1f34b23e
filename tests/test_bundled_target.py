"""The bundled target's code path at tiny size: tokenizer, joint LM+MTP pretraining, real-layout save, reload."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dmtp_hf.assistant.drafters.state import MTPState
from dmtp_hf.bundled import NotBuiltError, default_paths
from dmtp_hf.modeling.native_mtp import load_native_mtp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "reproduce"))  # reproduction code
from bundled_tokenizer import make_fast_tokenizer, save_tokenizer, train_bpe_tokenizer  # noqa: E402
from fast_kernels import fast_gated_delta_kernels  # noqa: E402
from target_pretraining import (  # noqa: E402
    PretrainConfig,
    build_target,
    joint_forward,
    pretrain,
    save_target_checkpoint,
    target_config,
    tokenize_documents,
    verify_target_checkpoint,
)

SENTENCES = [
    "hello there, how are you doing today?",
    "I am fine, thanks. What about you?",
    "def add(a, b):\n    return a + b\n",
    "Write the Python function `add` of the `operator` module.",
    "The quick brown fox jumps over the lazy dog 12345 times.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(make_fast_tokenizer(train_bpe_tokenizer(SENTENCES * 4, vocab_size=300)), path)
    return AutoTokenizer.from_pretrained(path)


def test_tokenizer_specials_and_chat_template(tokenizer, tmp_path):
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tokenizer.mask_token == "<|MASK|>" and tokenizer.mask_token_id == 3
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2 and tokenizer.decode(ids) == rendered
    code = "def f(x):\n\treturn  x ** 2  # ü\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code  # byte-level: lossless
    save_tokenizer(tokenizer, tmp_path)
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_fast_kernels_match_transformers():
    model, head = build_target(target_config(64, "tiny"), seed=1)
    input_ids = torch.randint(0, 64, (2, 45))  # not a multiple of either chunk size
    reference = joint_forward(model, head, input_ids, return_mtp_logits=True)
    reference.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(), head.zero_grad()
    with fast_gated_delta_kernels():
        fast = joint_forward(model, head, input_ids, return_mtp_logits=True)
        fast.loss.backward()
    torch.testing.assert_close(fast.mtp_logits, reference.mtp_logits, atol=1e-5, rtol=1e-4)
    for grad, parameter in zip(grads, model.parameters()):
        torch.testing.assert_close(parameter.grad, grad, atol=1e-5, rtol=1e-3)


def test_real_layout_round_trip_float32(tmp_path):
    model, head = build_target(target_config(64, "tiny"), seed=2)
    with torch.no_grad():  # non-trivial norms, so a dropped `1 + w` or a swapped norm would show
        for name, parameter in head.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    save_target_checkpoint(model, head, tmp_path, dtype=torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    expected = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
    assert expected <= names and any(n.startswith("mtp.layers.0.self_attn.") for n in names)
    assert not any(n.startswith(("projection", "layer.", "final_norm")) for n in names)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.model_type == "qwen3_5_text" and loaded.config.mtp_num_hidden_layers == 1
    loaded_head = load_native_mtp(loaded)
    input_ids = torch.randint(0, 64, (2, 20))
    model.eval(), head.eval()
    with torch.no_grad():
        expected_out = joint_forward(model, head, input_ids, return_mtp_logits=True)
        actual_out = joint_forward(loaded, loaded_head, input_ids, return_mtp_logits=True)
    torch.testing.assert_close(actual_out.mtp_logits, expected_out.mtp_logits, atol=1e-6, rtol=1e-6)
    # The decoding-round API of the loaded head agrees with the teacher-forced training pass.
    hidden = loaded(input_ids=input_ids, output_hidden_states=True).hidden_states[-1]
    state = MTPState(loaded_head)
    state.consume(input_ids[:, 1:-1], hidden[:, :-2])  # the pairs of the training pass
    logits, _ = state.predict()
    torch.testing.assert_close(logits, expected_out.mtp_logits[:, -1], atol=1e-5, rtol=1e-5)


def test_pretrain_saves_verifies_and_resumes(tokenizer, tmp_path):
    documents = [s + "<|endoftext|>" for s in SENTENCES] * 20
    tokens = tokenize_documents(documents, tokenizer)
    config_kwargs = dict(preset="tiny", seq_len=24, batch_size=2, warmup_steps=2, lr=1e-2, eval_batches=1)
    config = PretrainConfig(output_dir=str(tmp_path), max_steps=3, save_every=3, eval_every=3, **config_kwargs)
    first = pretrain(config, tokens, tokens, tokenizer)
    assert first["step"] == 3 and torch.isfinite(torch.tensor(first["loss"]))
    state = json.loads((tmp_path / "model" / "training_state.json").read_text())
    assert state["step"] == 3 and max(state["verify"].values()) <= 1e-4
    assert (tmp_path / "model" / "tokenizer.json").exists()

    resumed = pretrain(
        PretrainConfig(output_dir=str(tmp_path), max_steps=5, save_every=5, eval_every=5, **config_kwargs),
        tokens,
        tokens,
        tokenizer,
    )
    assert resumed["step"] == 5 and resumed["tokens_seen"] == 5 * 2 * 24

    # The bf16 export reloads through the public path and matches the training modules rounded to bf16.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert loaded.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="settings differ"):
        pretrain(
            PretrainConfig(output_dir=str(tmp_path), max_steps=6, **{**config_kwargs, "lr": 1e-3}),
            tokens,
            tokens,
            tokenizer,
        )


def test_verify_detects_a_wrong_checkpoint(tmp_path):
    model, head = build_target(target_config(64, "tiny"), seed=3)
    save_target_checkpoint(model, head, tmp_path, dtype=torch.float32)
    with torch.no_grad():
        head.projection.weight.mul_(2.0)
    with pytest.raises(AssertionError, match="does not reproduce"):
        verify_target_checkpoint(tmp_path, model, head, torch.randint(0, 64, (1, 12)), dtype=torch.float32)


def test_default_paths_reports_unbuilt_models(monkeypatch, tmp_path):
    import dmtp_hf.bundled as bundled

    monkeypatch.setattr(bundled, "MODELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="bundled models are not built yet"):
        default_paths()
    with pytest.raises(NotBuiltError):
        default_paths(("target",))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    assert default_paths(("target",)) == {"target": tmp_path / "target"}
    with pytest.raises(KeyError):
        default_paths(("eagle",))
