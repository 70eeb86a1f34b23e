"""The generate contract: every option does what plain ``generate`` does, or is refused before any work with an
error that names it; bad weights and misuse fail with messages that point the right way (docs/generate-options.md).
"""

import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lossless import bundled  # noqa: F401 - the bundled target, its DMTP draft, tokenizer and a padded batch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import dmtp_hf
from dmtp_hf.assistant.options import REFUSED_OPTIONS


class Unchanged(LogitsProcessor):
    """A user processor Transformers knows nothing about (called per position with each row's exact prefix)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


@pytest.mark.parametrize("rows", [1, 2])
def test_user_processors_and_prefix_constraints_match_plain_generate(bundled, rows):  # noqa: F811
    target, draft, tokenizer, batch = bundled
    inputs = {k: v[:rows] for k, v in batch.items()}
    allowed = list(range(0, target.config.vocab_size, 2)) + [tokenizer.eos_token_id]
    for options in (
        {"logits_processor": LogitsProcessorList([Unchanged()])},
        {"prefix_allowed_tokens_fn": lambda row, ids: allowed},
    ):
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=24, **options)
        ours = target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=24, **options)
        assert torch.equal(plain, ours), options


@pytest.mark.parametrize(
    "option,value",
    [
        ("num_beams", 2),
        ("num_beam_groups", 2),
        ("guidance_scale", 1.5),
        ("penalty_alpha", 0.6),
        ("prompt_lookup_num_tokens", 3),
        ("use_mtp", True),
        ("output_hidden_states", True),
        ("output_attentions", True),
        ("dola_layers", "high"),
        # Transformers' own assisted decoding: accepted and ignored before (issue #62, item 6)
        ("num_assistant_tokens", 5),
        ("num_assistant_tokens_schedule", "heuristic"),
        ("assistant_confidence_threshold", 0.2),
        ("assistant_lookbehind", 3),
        ("target_lookbehind", 3),
        ("max_matching_ngram_size", 2),
    ],
)
def test_options_that_cannot_be_exact_are_refused_naming_them(bundled, option, value):  # noqa: F811
    target, draft, _, batch = bundled
    assert option in REFUSED_OPTIONS
    extra = {"num_beams": 4} if option == "num_beam_groups" else {}
    with pytest.raises(ValueError, match=rf"^{option}=.*not supported with assistant_model"):
        target.generate(
            **batch, assistant_model=draft, max_new_tokens=4, return_dict_in_generate=True, **{option: value}, **extra
        )
    with pytest.raises(ValueError, match="inputs_embeds"):
        embeds = target.get_input_embeddings()(batch["input_ids"][:1])
        target.generate(inputs_embeds=embeds, assistant_model=draft, max_new_tokens=4)


def test_assisted_decoding_options_are_refused_only_when_set_to_other_than_transformers_defaults(bundled):  # noqa: F811
    """Transformers fills its defaults (20 tokens, "constant", 0.4, 10, 10) into every call's generation config: those
    must pass, in the call or in a `generation_config`; another value, from either, is refused."""
    target, draft, _, batch = bundled
    inputs = {k: v[:1] for k, v in batch.items()}
    defaults = dict(
        num_assistant_tokens=20,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.4,
        assistant_lookbehind=10,
        target_lookbehind=10,
    )
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=6)
    assert torch.equal(
        plain, target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=6, **defaults)
    )
    config = GenerationConfig(do_sample=False, max_new_tokens=6, **defaults)
    assert torch.equal(plain, target.generate(**inputs, assistant_model=draft, generation_config=config))
    config.num_assistant_tokens = 3
    with pytest.raises(ValueError, match=r"^num_assistant_tokens=3 is not supported .*verify_length=N"):
        target.generate(**inputs, assistant_model=draft, generation_config=config)


@pytest.mark.parametrize("rows", [1, 3])
def test_scores_and_logits_are_returned_as_plain_generate_returns_them(bundled, rows):  # noqa: F811
    target, draft, _, batch = bundled
    inputs = {k: v[:rows] for k, v in batch.items()}
    options = dict(
        do_sample=False, max_new_tokens=20, output_scores=True, output_logits=True, return_dict_in_generate=True
    )
    plain = target.generate(**inputs, **options)
    ours = target.generate(**inputs, assistant_model=draft, **options)
    assert torch.equal(plain.sequences, ours.sequences)
    assert (
        len(ours.scores)
        == len(plain.scores)
        == len(ours.logits)
        == plain.sequences.shape[1] - inputs["input_ids"].shape[1]
    )
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for step, (ps, os_, pl, ol) in enumerate(zip(plain.scores, ours.scores, plain.logits, ours.logits)):
        for row in range(rows):
            generated = plain.sequences[row, inputs["input_ids"].shape[1] :].tolist()
            if any(t in eos for t in generated[:step]):
                assert torch.isinf(os_[row]).all()  # the row had finished: plain generate scored padding there
                continue
            torch.testing.assert_close(os_[row], ps[row], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ol[row], pl[row], rtol=1e-4, atol=1e-4)


def test_one_target_and_draft_in_two_threads(bundled):  # noqa: F811
    """State is per call: one thread decodes speculatively while another does (or runs plain generate) on the same
    target and draft; every output equals the sequential one."""
    target, draft, _, batch = bundled
    inputs = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    expected = [target.generate(**x, do_sample=False, max_new_tokens=32) for x in inputs]
    errors, results = [], {}

    def work(name, x, speculative):
        try:
            for _ in range(4):
                kw = {"assistant_model": draft} if speculative else {}
                results[name] = target.generate(**x, do_sample=False, max_new_tokens=32, **kw)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    for plan in ([(0, True), (1, True)], [(0, True), (1, False)]):
        threads = [threading.Thread(target=work, args=(i, inputs[i], s)) for i, s in plan]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert all(torch.equal(results[i], expected[i]) for i, _ in plan)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bundled):  # noqa: F811
    target, draft, _, _ = bundled
    draft.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "layers.0.mlp.up_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"non-finite.*{name}"):
        dmtp_hf.DMTPDraftModel.from_pretrained(tmp_path)


def test_misuse_errors_point_the_right_way(tmp_path, bundled):  # noqa: F811
    import json

    from conftest import tiny_draft_config, tiny_qwen3_target
    from test_modeling import write_dflash_checkpoint

    # a draft used without binding it to its target (a non-stateful target reaches Transformers' own loop)
    unbound = dmtp_hf.DMTPDraftModel(tiny_draft_config())
    with pytest.raises(AttributeError, match=r"bind it to its target .*target=target"):
        tiny_qwen3_target().generate(torch.tensor([[1, 2, 3]]), assistant_model=unbound, max_new_tokens=4)
    # a config that does not state its size
    write_dflash_checkpoint(tmp_path / "sizeless")
    config = json.loads((tmp_path / "sizeless" / "config.json").read_text())
    del config["num_hidden_layers"]
    (tmp_path / "sizeless" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing \['num_hidden_layers'\]"):
        dmtp_hf.DMTPDraftModel.from_pretrained(tmp_path / "sizeless")
    # a DMTP draft whose target ships no MTP head (a retrofitted head was trained for it)
    target = tiny_qwen3_target()
    retrofit = dmtp_hf.DMTPDraftModel(tiny_draft_config(dmtp_config={"mtp_source": "retrofit"})).bind(target)
    with pytest.raises(RuntimeError, match=r"retrofitted MTP head.*native_mtp=load_native_mtp\(target, checkpoint="):
        retrofit.native_mtp  # noqa: B018


def test_num_return_sequences_samples_expanded_rows(bundled):  # noqa: F811
    """Transformers expands each prompt into num_return_sequences rows before decoding; each is sampled on its own
    (the batched chi-square test in test_lossless.py checks each row's distribution)."""
    target, draft, _, batch = bundled
    inputs = {k: v[:2] for k, v in batch.items()}
    torch.manual_seed(0)
    out = target.generate(**inputs, assistant_model=draft, do_sample=True, num_return_sequences=3, max_new_tokens=12)
    plain = target.generate(**inputs, do_sample=True, num_return_sequences=3, max_new_tokens=12)
    assert out.shape[0] == plain.shape[0] == 6
    assert torch.equal(out[:, : inputs["input_ids"].shape[1]], plain[:, : inputs["input_ids"].shape[1]])


def test_the_readme_snippet_runs_as_pasted():
    """The README's Python snippet, exactly as written (it asserts its own losslessness)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = readme.split("## In Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "default_paths()" in snippet and "dtype=torch.float32" in snippet
    assert "set_threads()" in snippet  # a busy machine does not make its speculative run slower than its plain one
    threads = torch.get_num_threads()
    try:
        exec(compile(snippet, "README.md", "exec"), {})
    finally:
        torch.set_num_threads(threads)  # the snippet's choice is for its own process, not the rest of the suite


def test_the_demo_reports_medians_on_prompts_where_drafters_differ(capsys):
    from dmtp_hf.demo import REPEATS, run_demo

    assert run_demo(max_new_tokens=16) == 0  # every method lossless
    printed = capsys.readouterr().out
    assert "Qwen3.5-architecture" in printed and "make demo-smollm2" in printed
    assert f"median of {REPEATS} interleaved runs" in printed and REPEATS >= 3
    rows = [line.split() for line in printed.splitlines() if line.startswith(("DMTP", "DFlash", "native"))]
    assert len(rows) == 4 and len({row[-6] for row in rows}) > 1  # the tokens/round of the methods differ
    assert any(line.startswith('DMTP "auto"') for line in printed.splitlines())  # auto next to full width
