"""``dmtp demo``: what the README's first command runs.

With the bundled models (``dmtp_hf.bundled``) it chats with the project's own small Qwen3.5-architecture target and
its DMTP draft. Until they are built and committed, it runs on a tiny *randomly initialised* Qwen3.5-architecture
target (GatedDeltaNet + attention, native MTP head in the real ``mtp.*`` layout) and a random DMTP draft, and says
so: the output is then gibberish and acceptance is near zero, but every part of the pipeline runs (target
checkpoint -> native MTP head -> DMTP draft -> ``target.generate(assistant_model=draft)``, lossless).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch


def _bundled(name: str):
    from .bundled import NotBuiltError, default_paths

    try:
        return default_paths((name,))[name]
    except NotBuiltError:
        return None


def _random_models(directory: Path):
    from .modeling import DMTPConfig, DMTPDraftModel
    from .testing.tiny_targets import load_tiny_target, make_tiny_target

    overrides = {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "head_dim": 32,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    }
    target = load_tiny_target(make_tiny_target("qwen3_5", directory, vocab_size=1024, text_overrides=overrides))
    text = target.config.get_text_config(decoder=True)
    draft = DMTPDraftModel(
        DMTPConfig(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_target_layers=text.num_hidden_layers,
            mask_token_id=text.vocab_size - 1,
        )
    ).eval()
    return target, draft.bind(target), None


def run_demo(max_new_tokens: int = 48, seed: int = 0) -> int:
    """Run the demo and return a process exit code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dmtp_hf

    from .modeling import DMTPDraftModel

    torch.manual_seed(seed)
    target_path, draft_path = _bundled("target"), _bundled("dmtp")
    with tempfile.TemporaryDirectory() as tmp:
        if target_path is None:
            print(
                "NOTE: the bundled trained models are not built yet (see scripts/reproduce/README.md): this demo "
                "runs a tiny RANDOMLY INITIALISED Qwen3.5-architecture target and DMTP draft. Expect gibberish and "
                "near-zero acceptance; the point is the lossless pipeline."
            )
            target, assistant, tokenizer = _random_models(Path(tmp) / "target")
            prompt_ids = torch.randint(0, 1000, (1, 16))
            strategy = None
        else:
            target = AutoModelForCausalLM.from_pretrained(target_path).eval()
            tokenizer = AutoTokenizer.from_pretrained(target_path)
            # The code-request shape of the bundled target's training data (scripts/reproduce/build_corpus.py).
            request = (
                "Write the Python function `fibonacci` of the `mathutils` module.\n\n"
                "Signature: `def fibonacci(n):`\n\nDocstring: Return the n-th Fibonacci number."
            )
            messages = [{"role": "user", "content": request}]
            prompt_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            if draft_path is not None:
                assistant, strategy = DMTPDraftModel.from_pretrained(draft_path, target=target).eval(), None
            else:
                print(
                    "NOTE: the bundled DMTP draft is not trained yet: drafting with the bundled target's own native "
                    "MTP head alone (MTP-2, the native-MTP baseline)."
                )
                assistant, strategy = dmtp_hf.load_native_mtp(target), "mtp"
        if strategy is None:
            cfg = assistant.config
            what = f"DMTP draft: layout={cfg.anchor_layout} fusion={cfg.fusion}, {cfg.num_candidates} candidates/round"
        else:
            what = "native MTP head chained 2 steps"
        print(f"target: {type(target).__name__} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M); {what}")

        kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens)
        target.generate(prompt_ids, **kwargs)  # warm-up
        start = time.perf_counter()
        plain = target.generate(prompt_ids, **kwargs)
        plain_seconds = time.perf_counter() - start
        start = time.perf_counter()
        out = dmtp_hf.generate(
            target, prompt_ids, assistant, strategy=strategy, mtp_steps=2, return_dict_in_generate=True, **kwargs
        )
        dmtp_seconds = time.perf_counter() - start

    new = out.sequences[0, prompt_ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else str(new.tolist())
    stats = out.spec_stats
    print(f"\n--- generated ({new.numel()} tokens) ---\n{text}\n")
    print(f"identical to plain greedy generate: {torch.equal(out.sequences, plain)}")
    print(
        f"acceptance length per verify: {stats.acceptance_length_per_verify:.3f} tokens/round "
        f"(first-candidate acceptance {100 * stats.first_candidate_acceptance:.1f}%, {stats.num_rounds} rounds)"
    )
    print(
        f"wall time: plain {plain_seconds:.2f}s, DMTP {dmtp_seconds:.2f}s "
        f"-> speedup {plain_seconds / dmtp_seconds:.2f}x"
    )
    return 0
