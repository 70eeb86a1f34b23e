"""``dmtp eval``: acceptance statistics of several drafting strategies over prompt sets (DMTP blog §8 protocol).

Protocol by default: first 80 prompts of each set, the target's chat template with ``add_generation_prompt=True``
and ``enable_thinking=False``, T=0, up to 1,024 new tokens per turn, stop at EOS. Multi-turn prompts (MT-Bench)
are answered turn by turn, each strategy carrying *its own* previous answers into the next turn; every turn is
one request of the statistics. Every metric is docs/design.md §6's, computed by :class:`~dmtp_hf.SpecStats`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..assistant.generate import generate as dmtp_generate
from ..assistant.stats import SpecStats
from .models import ModelPaths, Strategy, eos_token_ids, lookup_of
from .prompts import DEFAULT_LIMIT, PromptSet

SCHEMA = "dmtp-eval/1"
BASELINE = "generate"  # label of plain ``target.generate`` in ``results["baseline"]``
ALL_DATASETS = "overall"  # key of the all-datasets entry in ``results["baseline"]``


@dataclass
class EvalSettings:
    """Generation settings shared by every strategy of one evaluation."""

    limit: int | None = DEFAULT_LIMIT
    max_new_tokens: int = 1024
    temperature: float = 0.0
    verify_mode: str | None = None  # None: greedy at T=0, "match" (the blog's target-only verification) otherwise
    chat_template: bool = True
    enable_thinking: bool = False
    seed: int = 0
    batch_size: int = 1
    baseline: bool = True  # also time plain ``target.generate`` on the same turns (wall-clock speedup)
    verify_length: int | str | None = None  # candidates per round: None (all K), a number, or "auto"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 (got {self.limit})")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (got {self.temperature})")
        if self.batch_size != 1:
            # Batched speculative decoding comes later; acceptance statistics do not depend on the batch.
            raise ValueError("speculative strategies currently run at batch size 1 only (--batch-size 1)")

    @property
    def do_sample(self) -> bool:
        """Whether the target is sampled."""
        return self.temperature > 0

    @property
    def resolved_verify_mode(self) -> str:
        """The verification mode actually used."""
        return self.verify_mode or ("match" if self.do_sample else "greedy")


def encode_conversation(tokenizer, messages: list[dict[str, str]], settings: EvalSettings) -> torch.Tensor:
    """Token ids ``[1, P]`` of a conversation ending with a user turn, ready for the assistant's reply."""
    if settings.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target tokenizer has no chat template; pass --no-chat-template to use raw prompts")
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=settings.enable_thinking
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        text = "\n\n".join(message["content"] for message in messages)
        ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError("a prompt encoded to zero tokens")
    return ids


def generation_kwargs(settings: EvalSettings, eos: list[int], pad: int | None) -> dict[str, Any]:
    """Keyword arguments of every ``generate`` call of a run (identical for all strategies and baselines)."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": settings.do_sample,
        "eos_token_id": eos,
        "pad_token_id": pad if pad is not None else (eos[0] if eos else None),
    }
    if settings.do_sample:
        # Pure temperature sampling: the checkpoint's default top-k/top-p would change what is measured.
        kwargs.update(temperature=settings.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    return kwargs


def _finite(value: Any) -> Any:
    """NaN/inf -> None recursively, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def stats_entry(stats: SpecStats, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``SpecStats.to_dict()`` (every metric, raw histogram, per-request counts) plus run-level extras."""
    return _finite({**stats.to_dict(), **(extra or {})})


def _run_prompt_set(
    pset: PromptSet,
    labels: list[str],
    strategies: list[Strategy],
    target,
    tokenizer,
    settings: EvalSettings,
    gen_kwargs: dict[str, Any],
    bar,
):
    """Every turn of one prompt set under every label (plain ``generate`` first): statistics, per-request
    metadata, wall seconds and a digest of the generated tokens, per label."""
    device = next(target.parameters()).device
    drafters = {s.label: s.drafter for s in strategies}
    widths = {s.label: _verify_length(s, settings) for s in strategies}
    stats = {s.label: SpecStats(s.num_candidates, s.label) for s in strategies}
    meta: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    seconds = dict.fromkeys(labels, 0.0)
    digests: dict[str, Any] = {label: hashlib.sha256() for label in labels}
    for prompt_index, prompt in enumerate(pset.prompts):
        for label in labels:
            bar.set_postfix_str(f"{pset.name}/{label}", refresh=False)
            messages: list[dict[str, str]] = []
            for turn_index, turn in enumerate(prompt.turns):
                messages.append({"role": "user", "content": turn})
                input_ids = encode_conversation(tokenizer, messages, settings).to(device)
                if settings.do_sample:  # same seed per (prompt, turn) for every strategy
                    torch.manual_seed(settings.seed + 1000 * prompt_index + turn_index)
                start = time.perf_counter()
                if label == BASELINE:
                    sequences = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **gen_kwargs)
                else:
                    out = dmtp_generate(
                        target,
                        input_ids,
                        drafters[label],
                        verify_mode=settings.resolved_verify_mode,
                        verify_length=widths[label],
                        prompt_lookup=lookup_of(label) if widths[label] == "auto" else None,
                        attention_mask=torch.ones_like(input_ids),
                        return_dict_in_generate=True,
                        **gen_kwargs,
                    )
                    sequences = out.sequences
                seconds[label] += time.perf_counter() - start
                if label != BASELINE:
                    stats[label].merge(out.spec_stats)
                new_tokens = sequences[0, input_ids.shape[1] :].tolist()
                digests[label].update(repr(new_tokens).encode())
                meta[label].append(
                    {
                        "question_id": prompt.question_id,
                        "turn": turn_index,
                        "prompt_tokens": int(input_ids.shape[1]),
                        "output_tokens": len(new_tokens),
                    }
                )
                reply = tokenizer.decode(new_tokens, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": reply})
                bar.update()
    return stats, meta, seconds, digests


def run_acceptance_eval(
    target,
    tokenizer,
    prompt_sets: list[PromptSet],
    strategies: list[Strategy],
    settings: EvalSettings,
    *,
    paths: ModelPaths | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every strategy over every prompt set; returns the JSON-serialisable results (schema ``dmtp-eval/1``).

    ``results[dataset][strategy]`` holds ``SpecStats.to_dict()`` (``hist``, ``requests`` with per-request
    ``rounds``/``round_tokens``/``hist``, and all derived metrics) plus ``request_meta`` (question id, turn, prompt
    and output lengths per request, aligned with ``requests``), output tokens and wall seconds. ``overall`` merges
    all datasets. ``outputs_identical[dataset]`` says whether every strategy produced the same tokens (expected at
    T=0: all strategies are lossless).
    """
    eos = eos_token_ids(target, tokenizer)
    gen_kwargs = generation_kwargs(settings, eos, tokenizer.pad_token_id)
    device = next(target.parameters()).device
    # Plain decoding runs first on every turn, under the same conditions, so each strategy's speedup is measured
    # against it in the same run (ratios, not absolute tokens/s, are what survives a noisy machine).
    labels = ([BASELINE] if settings.baseline else []) + [s.label for s in strategies]
    cost_seconds = _measure_auto_costs(target, strategies, settings)
    total = sum(s.num_turns for s in prompt_sets) * len(labels)
    results: dict[str, dict[str, Any]] = {}
    baseline: dict[str, dict[str, Any]] = {}
    identical: dict[str, bool] = {}
    bar = tqdm(total=total, desc="dmtp eval", unit="turn", disable=not progress, dynamic_ncols=True)
    try:
        for pset in prompt_sets:
            stats, meta, seconds, digests = _run_prompt_set(
                pset, labels, strategies, target, tokenizer, settings, gen_kwargs, bar
            )
            timing = {
                label: {
                    "output_tokens": sum(m["output_tokens"] for m in meta[label]),
                    "wall_seconds": seconds[label],
                    "output_digest": digests[label].hexdigest(),
                }
                for label in labels
            }
            if settings.baseline:
                baseline[pset.name] = {**timing[BASELINE], "request_meta": meta[BASELINE]}
            results[pset.name] = {
                s.label: stats_entry(stats[s.label], {"request_meta": meta[s.label], **timing[s.label]})
                for s in strategies
            }
            identical[pset.name] = len({t["output_digest"] for t in timing.values()}) <= 1
    finally:
        bar.close()

    return finalize_results(
        {
            "schema": SCHEMA,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "environment": _environment(device),
            "settings": {**asdict(settings), "verify_mode": settings.resolved_verify_mode},
            # measured, not chosen: kept out of ``settings`` so that runs of the same settings merge
            "auto_cost_measure_seconds": cost_seconds,
            "models": _model_info(target, paths),
            "strategies": [s.describe() for s in strategies],
            "datasets": [
                {
                    "name": s.name,
                    "display_name": s.display_name,
                    "source": s.source,
                    "num_prompts": len(s.prompts),
                    "num_turns": s.num_turns,
                }
                for s in prompt_sets
            ],
            "results": results,
            "baseline": baseline,
            "outputs_identical": identical,
        }
    )


def _verify_length(strategy: Strategy, settings: EvalSettings) -> int | str | None:
    """The label's own width (``dmtp:auto``), else the run's ``--verify-length``."""
    return strategy.verify_length if strategy.verify_length is not None else settings.verify_length


def _measure_auto_costs(target, strategies: list[Strategy], settings: EvalSettings) -> float:
    """Time the target's forward per width for the ``auto`` strategies before any turn is timed (what a server pays
    once at start-up; cached per target, device, dtype and batch size). Returns the seconds it took."""
    from ..assistant.widths import CostModel

    start = time.perf_counter()
    for strategy in strategies:
        if _verify_length(strategy, settings) == "auto":
            CostModel.measure(target, settings.batch_size, strategy.num_candidates + 1)
    return time.perf_counter() - start


def _throughput(entry: dict[str, Any]) -> float:
    return entry["output_tokens"] / entry["wall_seconds"] if entry.get("wall_seconds") else float("nan")


def finalize_results(results: dict[str, Any]) -> dict[str, Any]:
    """Derive what follows from the per-dataset entries: ``overall`` (all datasets merged, recomputed from the
    per-request counts), tokens/s, and each strategy's wall-clock speedup over the plain ``generate`` baseline timed
    in the same run as it (``column_baselines[label]`` for columns merged from another run, else ``baseline``;
    tokens/s ratio; at T=0 both produce the same tokens). Idempotent."""
    labels = [s["label"] for s in results["strategies"]]
    datasets = [d["name"] for d in results["datasets"]]
    overall: dict[str, Any] = {}
    for label in labels:
        entries = [results["results"][name][label] for name in datasets]
        merged = SpecStats(entries[0]["num_candidates"], label)
        for entry in entries:
            merged.merge(SpecStats.from_dict(entry))
        overall[label] = stats_entry(
            merged,
            {
                "output_tokens": sum(e.get("output_tokens", 0) for e in entries),
                "wall_seconds": sum(e.get("wall_seconds", 0.0) for e in entries),
            },
        )
    column_baselines = results.get("column_baselines") or {}
    for baseline in [results.get("baseline") or {}, *column_baselines.values()]:
        if not baseline:
            continue
        baseline[ALL_DATASETS] = {
            "output_tokens": sum(baseline[name]["output_tokens"] for name in datasets),
            "wall_seconds": sum(baseline[name]["wall_seconds"] for name in datasets),
        }
        for name in [*datasets, ALL_DATASETS]:
            baseline[name]["tokens_per_second"] = _throughput(baseline[name])
    for name, by_label in [*((name, results["results"][name]) for name in datasets), (ALL_DATASETS, overall)]:
        for label, entry in by_label.items():
            baseline = column_baselines.get(label) or results.get("baseline") or {}
            base = baseline[name]["tokens_per_second"] if baseline else math.nan
            entry["tokens_per_second"] = _throughput(entry)
            entry["speedup"] = entry["tokens_per_second"] / base
    results["overall"] = overall
    return _finite(results)


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    from .. import __version__

    env = {
        "dmtp_hf": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _model_info(target, paths: ModelPaths | None) -> dict[str, Any]:
    text_config = target.config.get_text_config(decoder=True)
    info: dict[str, Any] = {
        "target": paths.target if paths else getattr(target.config, "_name_or_path", None),
        "target_model_type": text_config.model_type,
        "target_architecture": type(target).__name__,
        "dtype": str(target.get_input_embeddings().weight.dtype).removeprefix("torch."),
    }
    if paths is not None:
        info.update(draft=paths.draft, dflash_draft=paths.dflash_draft, extra_drafts=paths.extra_drafts)
    return info
