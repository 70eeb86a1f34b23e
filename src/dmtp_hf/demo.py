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
            # Stored in bf16; fp32 is the fast CPU dtype (the comparison report runs fp32 too).
            target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
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

        # Side by side on the same prompt: the DMTP draft, and the baselines a user would compare it with.
        contenders = [("DMTP" if strategy is None else "native MTP-2", assistant, strategy, 2)]
        dflash_path = _bundled("dflash") if target_path is not None and strategy is None else None
        if dflash_path is not None:
            contenders.append(("DFlash", DMTPDraftModel.from_pretrained(dflash_path, target=target).eval(), None, 1))
        if strategy is None and target_path is not None:
            contenders.append(("native MTP-1", assistant, "mtp", 1))
        kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens)
        target.generate(prompt_ids, **kwargs)  # warm-up
        start = time.perf_counter()
        plain = target.generate(prompt_ids, **kwargs)
        plain_seconds = time.perf_counter() - start
        runs = []
        for label, model, how, steps in contenders:
            # Warm-up: loads the native MTP head and touches every code path once, outside the timing.
            warm = dict(kwargs, max_new_tokens=8)
            dmtp_hf.generate(target, prompt_ids, model, strategy=how, mtp_steps=steps, **warm)
            start = time.perf_counter()
            out = dmtp_hf.generate(
                target, prompt_ids, model, strategy=how, mtp_steps=steps, return_dict_in_generate=True, **kwargs
            )
            runs.append((label, out, time.perf_counter() - start))

    label, out, _ = runs[0]
    new = out.sequences[0, prompt_ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else str(new.tolist())
    print(f"\n--- generated by {label} ({new.numel()} tokens) ---\n{text}\n")
    print(f"plain greedy generate: {plain_seconds:.2f}s")
    header = ["tokens/round", "first-cand.", "rounds", "time", "speedup"]
    print(f"{'method':14s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, (12, 12, 7, 7, 8))) + "  lossless")
    for label, out, seconds in runs:
        stats = out.spec_stats
        print(
            f"{label:14s} {stats.acceptance_length_per_verify:12.2f} {100 * stats.first_candidate_acceptance:11.1f}% "
            f"{stats.num_rounds:7d} {seconds:6.2f}s {plain_seconds / seconds:7.2f}x  "
            f"{torch.equal(out.sequences, plain)}"
        )
    print("(tokens/round = acceptance length per verify, bonus token included; CPU wall clock, one prompt)")
    return 0
