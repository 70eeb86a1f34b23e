import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dmtp_hf import DMTPConfig, DMTPDraftModel
from dmtp_hf_assets.tiny_targets import FAMILIES, load_tiny_target, make_tiny_target, tiny_tokenizer

VOCAB = 96
HIDDEN = 32

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core; a worker's own intra-op threads would only contend with the others.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def tiny_qwen3_target(num_layers: int = 4, hidden: int = HIDDEN, vocab: int = VOCAB) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_draft_config(**overrides) -> DMTPConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=VOCAB - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return DMTPConfig(**kwargs)


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny training models are overhead-bound, and more threads oversubscribe the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_decodes_as_plain_generate(target, draft, num_candidates: int, strategy: str) -> None:
    """``target.generate`` with ``draft`` equals plain greedy ``generate``, through ``strategy`` proposing
    ``num_candidates`` per round (the acceptance histogram has one bin per count 0..num_candidates)."""
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    out = target.generate(
        prompt, assistant_model=draft, do_sample=False, max_new_tokens=40, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_stats.strategy == strategy and len(out.spec_stats.hist) == num_candidates + 1


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state: a test asking for bf16 after another made it with "no" must not fail
    because of the order the tests ran in."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """One tiny random checkpoint (with its native MTP head) per family, loaded once per test module."""
    root = tmp_path_factory.mktemp("targets")
    return {family: load_tiny_target(make_tiny_target(family, root / family)) for family in FAMILIES}


@pytest.fixture
def target():
    return tiny_qwen3_target()


def draft_for(target, **overrides) -> DMTPDraftModel:
    text = target.config.get_text_config()
    hidden = text.hidden_size
    config = dict(
        vocab_size=text.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=[0, text.num_hidden_layers - 1],
        mask_token_id=text.vocab_size - 1,
    )
    config.update(overrides)
    torch.manual_seed(1)
    draft = DMTPDraftModel(DMTPConfig(**config)).eval()
    if draft.fusion is not None:  # a non-zero fusion, so that fusion bugs change the drafts
        with torch.no_grad():
            for p in draft.fusion.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return draft.bind(target)


@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    """A DeepSeek-V3 tiny target (with its MTP head) over a 6-token vocabulary, peaked but not degenerate."""
    target = load_tiny_target(make_tiny_target("deepseek_v3", tmp_path_factory.mktemp("v6"), vocab_size=6))
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    target.generation_config.eos_token_id = None
    return target


# The evaluation models: a tiny tokenizer and saved checkpoints the CLI can load


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """Tiny DeepSeek-V3 target (native MTP head; Transformers' use_mtp works on it) + tokenizer, a DMTP draft, a
    DFlash draft and a tiny Qwen3 assistant sharing the vocabulary, all saved as checkpoints."""
    root = tmp_path_factory.mktemp("eval_models")
    target_dir = make_tiny_target("deepseek_v3", root / "target")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(target_dir)
    target = load_tiny_target(target_dir)
    draft_for(target).save_pretrained(root / "dmtp")
    draft_for(target, anchor_layout="dflash").save_pretrained(root / "dflash")
    torch.manual_seed(2)
    assistant = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=128,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            eos_token_id=1,
            bos_token_id=0,
        )
    )
    assistant.save_pretrained(root / "assistant")
    tokenizer.save_pretrained(root / "assistant")
    return root
