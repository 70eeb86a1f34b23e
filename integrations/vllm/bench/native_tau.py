"""τ of DMTP with a family's own head: vLLM (dmtp-vllm) against dmtp-hf's engine, on the same tiny checkpoint,
draft and prompts.

On a random tiny checkpoint nothing is accepted (τ ≈ 1 in both engines, which proves nothing), so the head and the
draft first learn the target's own greedy text: a z-lab-layout DFlash draft is continued into DMTP jointly with the
target's MTP head (`dmtp_hf.training.Trainer`, ``train_mtp_head: joint``), the trained head is written into a copy of
the target (``dmtp export-mtp``: the head vLLM's ``mtp`` method and the plugin read) and the draft exported for vLLM
(``dmtp convert --to vllm``). Then both engines decode the same prompts greedily, one at a time, every proposal
verified: τ per verify, first-candidate acceptance, and whether the tokens agree.

    .venv/bin/python integrations/vllm/bench/native_tau.py --family qwen3_next     # a few minutes

Runs in dmtp-hf's environment; vLLM's engine in its own process (``families.probe``). GatedDeltaNet families run
bf16 in vLLM's CPU build and here alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402

NEW_TOKENS = 32


def learn_the_targets_text(root: Path, family: str, steps: int) -> tuple[Path, Path, list[list[int]]]:
    """The target (its head trained jointly with the draft, written back into a copy), the trained draft, and the
    prompts the training text continued (a random tiny target's text is learned by heart, not generalised: the
    engines are compared on the prompts whose continuations the head and the draft learned)."""
    from dmtp_hf.cli import main as dmtp
    from dmtp_hf.training import TrainConfig, Trainer
    from dmtp_hf.training.data import TokenizedDataset
    from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_dflash_draft, make_tiny_target

    original = make_tiny_target(family, root / "target", vllm_kernels=True)
    model = load_tiny_target(original).eval()
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, vocab - 1, (64, 8), generator=generator)
    with torch.no_grad():  # the target's own greedy continuations: what the draft and the head learn
        text = model.generate(prompts, max_new_tokens=56, min_new_tokens=56, do_sample=False)
    loss_mask = torch.ones_like(text[0])
    loss_mask[:8] = 0
    data = TokenizedDataset([{"input_ids": row, "loss_mask": loss_mask} for row in text])
    make_tiny_dflash_draft(original, root / "dflash")
    values = {
        "target_model": str(original),
        "init_from": str(root / "dflash"),
        "anchor_layout": "dual",
        "fusion": "residual",
        "draft_config": {"mask_token_id": vocab - 1},
        "train_mtp_head": "joint",
        "train_data": "unused",  # the dataset is given
        "max_length": 64,
        "num_anchors": 16,
        "micro_batch_size": 8,
        "max_steps": steps,
        "learning_rate": 3e-3,
        "warmup_ratio": 0.05,
        "output_dir": str(root / "run"),
        "save_every": 0,
        "eval_every": 0,
        "report_to": "none",
        "resume_from": None,
    }
    Trainer(TrainConfig.from_dict(values), target=model, train_dataset=data).train()
    target = root / "target-trained-head"
    dmtp(["export-mtp", str(root / "run" / "final_mtp_head"), str(original), str(target)])
    draft = root / "dmtp-vllm"
    dmtp(["convert", str(root / "run" / "final"), str(draft), "--to", "vllm", "--target", str(target)])
    return target, root / "run" / "final", prompts.tolist()


def dmtp_hf_decode(target: Path, draft: Path, prompts: list[list[int]], dtype: torch.dtype) -> dict:
    """dmtp-hf's engine, one prompt at a time: tokens, τ per verify, first-candidate acceptance."""
    from dmtp_hf import DMTPDraftModel
    from dmtp_hf_assets.tiny_targets import load_tiny_target

    model = load_tiny_target(target, dtype=dtype).eval()
    dmtp = DMTPDraftModel.from_pretrained(draft, target=model).eval()
    tokens, hist = [], None
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            assistant_model=dmtp,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        hist = out.spec_stats.hist if hist is None else [a + b for a, b in zip(hist, out.spec_stats.hist, strict=True)]
    rounds = sum(hist)
    tau = 1 + sum(k * c for k, c in enumerate(hist)) / rounds
    return {"tokens": tokens, "tau": tau, "first_candidate": 1 - hist[0] / rounds, "rounds": rounds}


def vllm_decode(target: Path, draft: Path, family: str, prompts: list[list[int]]) -> dict:
    """dmtp-vllm, one prompt at a time (its own process): tokens, τ per verify, first-candidate acceptance."""
    settings = {**families.engine_settings(family), "draft": str(draft), "prompts": prompts}
    command = [str(families.VLLM_PYTHON), __file__, "--vllm", str(target), "--settings", json.dumps(settings)]
    env = families.vllm_env(set(range(os.cpu_count())))
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=families.REPO)
    return json.loads(families.answer_line(done.stdout, done.stderr))


def _run_vllm(target: str, settings: dict) -> None:
    """In vLLM's environment: decode each prompt alone, report tokens and the speculative counters."""
    from vllm import SamplingParams, TokensPrompt

    speculative = {"method": "dflash", "model": settings["draft"], "num_speculative_tokens": 7}
    engine = families.tiny_engine(target, settings, speculative, max_num_seqs=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens = []
    for prompt in settings["prompts"]:
        out = engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in engine.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"]
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    tau = 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts
    answer = {"tokens": tokens, "tau": tau, "first_candidate": per_position[0] / drafts, "rounds": drafts}
    print("@@ " + json.dumps(answer), flush=True)


def main() -> None:
    """Train, export, decode in both engines, print the comparison (module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3_next")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--output", type=Path, default=families.REPO / "reports" / "vllm" / "native_tau.json")
    parser.add_argument("--vllm", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm:
        _run_vllm(args.vllm, json.loads(args.settings))
        return
    dtype = torch.bfloat16 if families.engine_settings(args.family)["dtype"] == "bfloat16" else torch.float32
    with tempfile.TemporaryDirectory() as directory:
        target, draft, learned = learn_the_targets_text(Path(directory), args.family, args.steps)
        prompts = learned[: args.prompts]
        hf = dmtp_hf_decode(target, draft, prompts, dtype)
        vllm = vllm_decode(target, Path(directory) / "dmtp-vllm", args.family, prompts)
    same = sum(a == b for a, b in zip(hf["tokens"], vllm["tokens"], strict=True))
    result = {"family": args.family, "steps": args.steps, "dtype": str(dtype), "dmtp_hf": hf, "dmtp_vllm": vllm}
    result["identical_requests"] = same
    result["tau_ratio"] = vllm["tau"] / hf["tau"]
    print(
        f"{args.family} ({dtype}): tau per verify dmtp-hf {hf['tau']:.3f}, dmtp-vllm {vllm['tau']:.3f} "
        f"(ratio {result['tau_ratio']:.3f}); first-candidate {hf['first_candidate']:.3f} / "
        f"{vllm['first_candidate']:.3f}; identical tokens in {same} of {len(prompts)} requests"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
