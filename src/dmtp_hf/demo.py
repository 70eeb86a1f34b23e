"""``dmtp demo``: what the README's first command runs.

It chats with the project's own small Qwen3.5-architecture target (``dmtp_hf.bundled``) through its best DMTP
configuration (the target's MTP head tuned on regenerated text and the DMTP draft adapted to it), then runs
DMTP (every round at full width, and with ``verify_length="auto"``), DFlash and the native MTP head alone (MTP-1)
side by side on the same prompts: tokens per round, first-candidate acceptance, wall-clock speedup over plain
``generate``, and whether the output is identical. Methods are timed interleaved (one run of each in turn), so
that a change in machine load hits every column alike.
``--bundle smollm2`` does the same on SmolLM2-135M-Instruct with its retrofitted MTP head (``make demo-smollm2``).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from tqdm.auto import tqdm

from .machine import set_threads

# Requests per bundle, in the shapes of its evaluation (a code request, a chat turn, an open question): drafters
# differ on them (on the code request alone every drafter of the toy target accepts almost everything).
DEMO_REQUESTS = {
    "bundled": [
        "Write the Python function `fibonacci` of the `mathutils` module.\n\nSignature: `def fibonacci(n):`\n\n"
        "Docstring: Return the n-th Fibonacci number.",
        "what food do you like?",
        "Compose an engaging travel blog post about a recent trip to Hawaii.",
    ],
    "smollm2": [
        "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number.",
        "A shop sells 3 apples for $2. How much do 12 apples cost? Explain step by step.",
        "What are three tips for staying productive when working from home?",
    ],
}
ABOUT = {
    "bundled": "The toy target is a small Qwen3.5-architecture model this project pretrained on CPU: its text "
    "is not meaningful, only its speculation is. `make demo-smollm2` runs the same on SmolLM2-135M-Instruct.",
    "smollm2": "SmolLM2-135M-Instruct with a retrofitted MTP head and drafts trained on its own answers (CPU budget).",
}
REPEATS = 3  # timed runs per method after a warm-up; the median is reported (CPU timings swing)
DEMO_TOKENS = {"bundled": 96, "smollm2": 64}  # new tokens per prompt: SmolLM2 is ~15x the bundled target per token


def _interleaved_medians(runs: dict, prompts: list, repeats: int = REPEATS) -> dict[str, tuple[list[float], object]]:
    """The timed wall times (sorted) and last output of each ``runs[label](prompts)``, one run of each in turn.

    Round 0 is an untimed warm-up on the first prompt alone (kernels, caches, the costs ``auto`` times once); a
    progress bar on stderr counts every run, since on a busy machine one method can take minutes.
    """
    times: dict[str, list[float]] = {label: [] for label in runs}
    outputs: dict[str, object] = {}
    with tqdm(total=len(runs) * (repeats + 1), desc="demo runs", file=sys.stderr, leave=False) as bar:
        for round_index in range(repeats + 1):
            for label, run in runs.items():
                bar.set_postfix_str(f"{label}, {'warm-up' if round_index == 0 else f'run {round_index}/{repeats}'}")
                start = time.perf_counter()
                outputs[label] = run(prompts if round_index else prompts[:1])
                if round_index:
                    times[label].append(time.perf_counter() - start)
                bar.update()
    return {label: (sorted(ts), outputs[label]) for label, ts in times.items()}


def _median(times: list[float]) -> float:
    return times[len(times) // 2]


def run_demo(max_new_tokens: int | None = None, seed: int = 0, bundle: str = "bundled") -> int:
    """Run the demo on a bundle's models (``bundled`` or ``smollm2``) and return a process exit code.
    ``max_new_tokens``: per prompt (default `DEMO_TOKENS` of the bundle: a few minutes on two CPU cores)."""
    max_new_tokens = max_new_tokens or DEMO_TOKENS[bundle]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dmtp_hf

    from .bundled import bundle_paths
    from .modeling import DMTPDraftModel, load_native_mtp

    torch.manual_seed(seed)
    if "OMP_NUM_THREADS" not in os.environ:  # threads that do not oversubscribe a busy machine (a user's setting wins)
        set_threads()
    paths = bundle_paths(bundle)
    # Stored in bf16; fp32 is the fast CPU dtype and keeps greedy output token for token plain generate's.
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for request in DEMO_REQUESTS[bundle]
    ]
    # The MTP head: the target's own, or a retrofitted one (SmolLM2 ships none).
    head = load_native_mtp(target, checkpoint=paths["mtp_head"]) if paths["mtp_head"] else None
    # `bind` casts each draft to the target's dtype (the SmolLM2 drafts are stored in bf16).
    dmtp = DMTPDraftModel.from_pretrained(paths["draft"]).bind(target, native_mtp=head).eval()
    dflash = DMTPDraftModel.from_pretrained(paths["dflash_draft"]).bind(target, native_mtp=head).eval()
    cfg = dmtp.config
    print(ABOUT[bundle])
    print(
        f"target: {type(target).__name__} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M); DMTP draft: "
        f"layout={cfg.anchor_layout} fusion={cfg.fusion}, {cfg.num_candidates} candidates/round; MTP head: "
        + (f"{paths['mtp_head'].name}" if paths["mtp_head"] else "the target's own")
    )
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens)

    def speculative(model, **options):
        return lambda batch: [
            dmtp_hf.generate(target, ids, model, return_dict_in_generate=True, **options, **kwargs) for ids in batch
        ]

    methods = {
        "plain": lambda batch: [target.generate(ids, **kwargs) for ids in batch],
        "DMTP": speculative(dmtp),
        'DMTP "auto"': speculative(dmtp, verify_length="auto"),
        "DFlash": speculative(dflash),
        "native MTP-1": speculative(dmtp, strategy="mtp"),
    }
    timed = _interleaved_medians(methods, prompts)
    plain_times, plain = timed.pop("plain")
    runs = [(label, outs, times) for label, (times, outs) in timed.items()]
    _print_results(tokenizer, prompts, plain, plain_times, runs)
    return 0 if all(torch.equal(o.sequences, p) for _, outs, _ in runs for o, p in zip(outs, plain)) else 1


def _print_results(tokenizer, prompts, plain, plain_times: list[float], runs) -> None:
    """The first answer, then a table: tokens per round and first-candidate acceptance over all prompts, median
    time with the spread of the runs, speedup over plain ``generate`` (not ranked where the runs of the two overlap),
    and whether every output is plain ``generate``'s."""
    from .assistant.stats import SpecStats

    new = runs[0][1][0].sequences[0, prompts[0].shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True)
    print(f"\n--- generated by {runs[0][0]} ({new.numel()} tokens) ---\n{text}\n")
    plain_seconds = _median(plain_times)
    print(
        f"plain greedy generate: {plain_seconds:.2f}s{_spread(plain_times)} for {len(prompts)} prompts (median of "
        f"{REPEATS} runs; {torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''})"
    )
    header = ["tokens/round", "first-cand.", "rounds", "time", "speedup"]
    print(f"{'method':14s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, (12, 12, 7, 11, 8))) + "  lossless")
    overlapping = False
    for label, outs, times in runs:
        stats = SpecStats(outs[0].spec_stats.num_candidates, label)
        for out in outs:
            stats.merge(out.spec_stats)
        same = all(torch.equal(o.sequences, p) for o, p in zip(outs, plain))
        seconds = _median(times)
        within_noise = times[0] <= plain_times[-1] and plain_times[0] <= times[-1]  # the runs' ranges overlap
        overlapping |= within_noise
        speedup = f"{plain_seconds / seconds:.2f}x" + ("~" if within_noise else "")
        print(
            f"{label:14s} {stats.acceptance_length_per_verify:12.2f} {100 * stats.first_candidate_acceptance:11.1f}% "
            f"{stats.num_rounds:7d} {f'{seconds:.2f}s{_spread(times)}':>11s} {speedup:>8s}  {same}"
        )
    print(
        "(tokens/round = acceptance length per verify, bonus included; wall clock, median of "
        f'{REPEATS} interleaved runs after a warm-up, ± half the range of the runs; "auto" chooses each round\'s '
        "verify width from the draft's confidence and the measured cost of a verify, 0 = a plain decoding step)"
    )
    if overlapping:
        print("~: the runs of this method and of plain generate overlap: on this machine now, no ranking between them")


def _spread(times: list[float]) -> str:
    """``±N%``: half the range of the runs, relative to their median."""
    return f"±{50 * (times[-1] - times[0]) / _median(times):.0f}%"
