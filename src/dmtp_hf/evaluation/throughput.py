"""``dmtp bench``: end-to-end throughput of every decoding method a user would pick, side by side, in one run.

Throughput = output tokens / wall time of the whole workload (prefill included, docs/design.md §6), reported as a
ratio against plain ``target.generate`` at the same batch size. Rows: plain ``generate``; our DMTP, DFlash and
MTP-k (``dmtp_hf.generate``); Transformers' prompt-lookup decoding, ``use_mtp=True`` (``MTPCandidateGenerator``,
DeepSeek-V3/GLM-style heads), its own DFlash path (``speculation_type="dflash"``) on the run's DFlash weights, and
assisted decoding with a small ``--assistant``. A method Transformers or the
engine cannot run here is kept as a row with the reason (e.g. assisted decoding on a stateful hybrid target).

Plain ``generate`` and our strategies run batched (left padding, ragged acceptance); Transformers' assisted
decoding methods run at batch size 1 (their limit). To spread machine noise evenly, methods are interleaved per
prompt chunk (rotating their order) and the workload can be repeated; one warm-up call per method precedes all
timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..assistant.generate import compiled_verify_config
from ..assistant.generate import generate as dmtp_generate
from .acceptance import EvalSettings, _environment, _finite
from .models import Strategy

SCHEMA = "dmtp-bench/1"
RunFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Baseline:
    """One row of the benchmark: how to generate a batch, and the largest batch it supports (None: any)."""

    name: str
    description: str
    run: RunFn
    max_batch_size: int | None = 1
    skipped: str | None = None  # why it cannot run here (kept as a row with this note)
    note: str = ""
    measurements: dict[int, dict[str, float]] = field(default_factory=dict)

    def supports(self, batch_size: int) -> bool:
        """Whether this method can run at ``batch_size`` (and is not skipped)."""
        return self.skipped is None and (self.max_batch_size is None or batch_size <= self.max_batch_size)


def build_baselines(
    target,
    strategies: list[Strategy],
    gen_kwargs: dict[str, Any],
    *,
    prompt_lookup_tokens: int = 10,
    assistant=None,
    assistant_path: str | None = None,
    verify_mode: str | None = None,
    verify_length: int | str | None = None,
    compile: bool = False,
) -> list[Baseline]:
    """Plain ``generate``, our strategies, then Transformers' built-ins (with skip notes where unsupported).
    ``compile``: our strategies verify with a compiled target forward (batch size 1), next to plain ``generate``
    compiled the way Transformers does it (static cache, compiled decoding step)."""

    def plain(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return target.generate(ids, attention_mask=mask, **gen_kwargs)

    baselines = [Baseline("generate", "plain target.generate (reference)", plain, max_batch_size=None)]
    if compile:
        baselines.append(compiled_plain_baseline(target, gen_kwargs))

    for strategy in strategies:
        width = strategy.verify_length if strategy.verify_length is not None else verify_length

        def ours(
            ids: torch.Tensor, mask: torch.Tensor, drafter=strategy.drafter, width=width, lookup=strategy.prompt_lookup
        ) -> torch.Tensor:
            return dmtp_generate(
                target,
                ids,
                drafter,
                verify_mode=verify_mode,
                attention_mask=mask,
                verify_length=width,
                prompt_lookup=lookup if width == "auto" else None,
                compile=compile,
                **gen_kwargs,
            )

        plural = "s" if strategy.num_candidates != 1 else ""
        description = f"{strategy_method(strategy)}, {strategy.num_candidates} candidate{plural}"
        description += f", verify_length={width}" if width is not None else ""
        description += ", prompt lookup off" if strategy.prompt_lookup is False else ""
        description += ", compiled verify" if compile else ""
        # the batched engine; a compiled verify runs over a static cache, batch size 1
        baselines.append(Baseline(strategy.label, description, ours, max_batch_size=1 if compile else None))

    def builtin(**extra: Any) -> RunFn:
        def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return target.generate(ids, attention_mask=mask, **gen_kwargs, **extra)

        return run

    stateful = "Transformers' assisted decoding refuses stateful (linear-attention) targets"
    is_stateful = bool(getattr(target, "_is_stateful", False))
    lookup = Baseline(
        "prompt_lookup",
        f"Transformers prompt-lookup decoding (prompt_lookup_num_tokens={prompt_lookup_tokens})",
        builtin(prompt_lookup_num_tokens=prompt_lookup_tokens),
        skipped=stateful if is_stateful else None,
    )
    mtp = Baseline(
        "hf_use_mtp",
        "Transformers use_mtp=True (MTPCandidateGenerator)",
        builtin(use_mtp=True),
        skipped=stateful if is_stateful else None,
    )
    if mtp.skipped is None and getattr(target.config.get_text_config(), "num_mtp_layers", None) is None:
        mtp.skipped = f"Transformers has no use_mtp support for {target.config.get_text_config().model_type}"
    assisted = Baseline(
        "assisted",
        f"Transformers assisted decoding (assistant_model={assistant_path})",
        builtin(assistant_model=assistant),
        skipped=None if assistant is not None else "no --assistant given",
    )
    if assisted.skipped is None and is_stateful:
        assisted.skipped = stateful
    return [*baselines, lookup, mtp, transformers_dflash_baseline(target, strategies, builtin, stateful), assisted]


def transformers_dflash_baseline(target, strategies: list[Strategy], builtin, stateful: str) -> Baseline:
    """Transformers' own DFlash path (``speculation_type="dflash"``) on the weights of the run's DFlash strategy,
    converted to the assistant class it runs (`transformers_dflash_assistant`); a draft vocabulary is scored over
    the full vocabulary there (said in the row)."""
    from ..modeling.engine_export import transformers_dflash_assistant

    name, description = "hf_dflash", "Transformers speculation_type='dflash' (DFlashTokenCandidateGenerator)"
    source = next(
        (s for s in strategies if s.kind == "dflash" and s.details.get("backbone") != "dflash2"),
        None,
    )
    if getattr(target, "_is_stateful", False):
        return Baseline(name, description, builtin(), skipped=stateful)
    if source is None:
        return Baseline(name, description, builtin(), skipped="no DFlash strategy in this run to take weights from")
    draft = getattr(source.drafter, "draft", None)
    if draft is None:
        return Baseline(name, description, builtin(), skipped=f"{source.label} has no draft model to convert")
    try:
        assistant = transformers_dflash_assistant(draft, full_vocabulary=True)
    except ValueError as err:
        return Baseline(name, description, builtin(), skipped=str(err))
    description += f", the weights of {source.label}, {assistant.config.block_size - 1} candidates"
    if getattr(draft.config, "draft_vocab_size", None):
        description += f" (its {draft.config.draft_vocab_size}-token draft vocabulary scored over the full one)"
    return Baseline(name, description, builtin(assistant_model=assistant, speculation_type="dflash"))


def strategy_method(strategy: Strategy) -> str:
    """What a strategy runs, in words: ``our DFlash2`` for a draft on the DFlash2 backbone, ``DMTP (native MTP T1 +
    DFlash T2..)`` for a DMTP draft on the DFlash one, ``our native MTP`` for MTP-k."""
    if strategy.kind == "mtp":
        return "our native MTP"
    backbone = "DFlash2" if strategy.details.get("backbone") == "dflash2" else "DFlash"
    return f"our {backbone}" if strategy.kind == "dflash" else f"DMTP (native MTP T1 + {backbone} T2..)"


def compiled_plain_baseline(target, gen_kwargs: dict[str, Any]) -> Baseline:
    """Plain ``generate`` with Transformers' own compilation: a static cache and the compiled one-token step (on
    every device: Transformers compiles on CUDA only unless told otherwise)."""
    config = compiled_verify_config(target, True)
    config._compile_all_devices = True

    def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return target.generate(
            ids, attention_mask=mask, cache_implementation="static", compile_config=config, **gen_kwargs
        )

    return Baseline("generate_compiled", "plain target.generate, compiled (static cache)", run, max_batch_size=1)


def _pad_left(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into ``[B, P]`` ids and attention mask."""
    length = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - prompt.numel() :] = prompt
        mask[row, length - prompt.numel() :] = 1
    return ids, mask


def count_output_tokens(new_tokens: torch.Tensor, eos: list[int]) -> int:
    """Generated tokens per row up to and including the first EOS (what follows is padding), summed."""
    total = 0
    for row in new_tokens.tolist():
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        total += end
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(
    baselines: list[Baseline],
    prompt: torch.Tensor,
    pad_id: int,
    device,
    progress: bool,
    batch_sizes: tuple[int, ...] = (1,),
) -> None:
    """One warm-up per method and batch size (kernels, MTP/assistant loading, caches, and what ``auto`` widths time
    once per batch size); a method that fails here is skipped."""
    for baseline in tqdm(baselines, desc="dmtp bench warm-up", disable=not progress, dynamic_ncols=True):
        for bs in batch_sizes:
            if baseline.skipped is not None or not baseline.supports(bs):
                continue
            warm_ids, warm_mask = _pad_left([prompt] * bs, pad_id)
            try:
                baseline.run(warm_ids.to(device), warm_mask.to(device))
            except (ValueError, NotImplementedError, TypeError, AttributeError) as err:
                baseline.skipped = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]


def _time_batch_size(bs: int, active: list[Baseline], prompts, pad_id: int, eos, repeats: int, device, bar):
    """Every active method over every chunk of ``bs`` prompts, in an order rotated per chunk: summed output tokens
    and seconds per method, and (batch size 1, first repeat) each prompt's tokens."""
    chunks = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
    totals = {b.name: {"output_tokens": 0, "seconds": 0.0, "runs": [[0, 0.0] for _ in range(repeats)]} for b in active}
    outputs: dict[str, dict[int, list[int]]] = {b.name: {} for b in active}
    for repeat in range(repeats):
        for index, chunk in enumerate(chunks):
            ids, mask = _pad_left(chunk, pad_id)
            ids, mask = ids.to(device), mask.to(device)
            shift = (index + repeat) % len(active)
            for baseline in active[shift:] + active[:shift]:
                bar.set_postfix_str(f"bs={bs} {baseline.name}", refresh=False)
                _sync(device)
                start = time.perf_counter()
                sequences = baseline.run(ids, mask)
                _sync(device)
                elapsed = time.perf_counter() - start
                new = sequences[:, ids.shape[1] :]
                tokens = count_output_tokens(new, eos)
                totals[baseline.name]["output_tokens"] += tokens
                totals[baseline.name]["seconds"] += elapsed
                totals[baseline.name]["runs"][repeat][0] += tokens  # each repeat of the workload on its own
                totals[baseline.name]["runs"][repeat][1] += elapsed
                if bs == 1 and repeat == 0:
                    n = count_output_tokens(new, eos)
                    outputs[baseline.name][index] = new[0, :n].tolist()
                bar.update()
    return totals, outputs


def _record(bs: int, active: list[Baseline], totals, outputs, reference, plain: Baseline) -> None:
    """Each method's throughput at batch size ``bs``, its speedup over ``plain`` generate and (batch size 1) the
    share of prompts whose tokens equal plain generate's."""
    for baseline in active:
        t = totals[baseline.name]
        runs = [tokens / seconds for tokens, seconds in t["runs"] if seconds]
        entry = {
            "output_tokens": t["output_tokens"],
            "seconds": t["seconds"],
            "tokens_per_second": t["output_tokens"] / t["seconds"] if t["seconds"] else None,
            # every repeat of the workload on its own: the median and the spread (max - min) / median
            "tokens_per_second_runs": runs,
            "median_tokens_per_second": statistics.median(runs) if runs else None,
            "spread": (max(runs) - min(runs)) / statistics.median(runs) if len(runs) > 1 else None,
        }
        if outputs and reference:
            same = sum(outputs[baseline.name].get(i) == ref for i, ref in reference.items())
            entry["matches_generate"] = same / len(reference)
        baseline.measurements[bs] = entry
    base = plain.measurements.get(bs, {}).get("tokens_per_second")
    for baseline in active:
        tps = baseline.measurements[bs]["tokens_per_second"]
        baseline.measurements[bs]["speedup"] = tps / base if tps and base else None


def run_benchmark(
    target,
    prompts: list[torch.Tensor],
    baselines: list[Baseline],
    settings: EvalSettings,
    *,
    batch_sizes: list[int],
    eos: list[int],
    pad_id: int,
    repeats: int = 1,
    progress: bool = True,
    on_batch_size: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Time every baseline on the same prompts (1-D token tensors); returns the JSON-serialisable results.

    Per batch size: the prompts are split into chunks of that size; for every chunk, every method that supports
    the batch size generates it, in an order rotated per chunk. Throughput of a method = its output tokens / its
    summed wall time over the workload; ``speedup`` divides it by plain ``generate``'s at the same batch size.
    At batch size 1 each method's tokens are compared with plain ``generate``'s (``matches_generate``: the
    fraction of prompts with identical output, 1.0 for lossless greedy decoding).
    ``on_batch_size`` receives the results so far after each batch size (``"complete": False`` until the last), so a
    long run that is interrupted keeps what it measured.
    """
    device = next(target.parameters()).device
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"--batch-sizes must be positive (got {batch_sizes})")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {repeats})")

    _warm_up(baselines, prompts[0], pad_id, device, progress, tuple(batch_sizes))

    reference: dict[int, list[int]] = {}
    total_calls = sum(
        repeats * -(-len(prompts) // bs) * sum(1 for b in baselines if b.supports(bs)) for bs in batch_sizes
    )
    bar = tqdm(total=total_calls, desc="dmtp bench", unit="call", disable=not progress, dynamic_ncols=True)
    try:
        for bs in batch_sizes:
            active = [b for b in baselines if b.supports(bs)]
            totals, outputs = _time_batch_size(bs, active, prompts, pad_id, eos, repeats, device, bar)
            if bs == 1:
                reference = outputs["generate"]
            _record(bs, active, totals, outputs if bs == 1 else {}, reference, baselines[0])
            if on_batch_size is not None and bs != batch_sizes[-1]:
                on_batch_size(_results(baselines, settings, batch_sizes, repeats, prompts, device, complete=False))
    finally:
        bar.close()
    return _results(baselines, settings, batch_sizes, repeats, prompts, device, complete=True)


def _results(baselines, settings, batch_sizes, repeats, prompts, device, *, complete: bool) -> dict[str, Any]:
    """The JSON-serialisable results of the batch sizes measured so far (the others ``None``)."""
    return _finite(
        {
            "schema": SCHEMA,
            "complete": complete,
            "environment": _environment(device),
            "settings": {
                "max_new_tokens": settings.max_new_tokens,
                "temperature": settings.temperature,
                "limit": settings.limit,
                "chat_template": settings.chat_template,
                "enable_thinking": settings.enable_thinking,
                "batch_sizes": list(batch_sizes),
                "repeats": repeats,
                "num_prompts": len(prompts),
                "prompt_tokens": sum(int(p.numel()) for p in prompts),
            },
            "baselines": [
                {
                    "name": b.name,
                    "description": b.description,
                    "max_batch_size": b.max_batch_size,
                    "skipped": b.skipped,
                    "results": {str(bs): b.measurements.get(bs) for bs in batch_sizes},
                }
                for b in baselines
            ],
        }
    )


def _lossless_cell(baseline: dict[str, Any], sampled: bool) -> str:
    """Whether a method's tokens equalled plain ``generate``'s on every prompt (batch size 1, greedy)."""
    match = (baseline["results"].get("1") or {}).get("matches_generate")
    if baseline["name"] == "generate":
        return "reference"
    if match is None or sampled:
        return "n/a"
    return "yes" if match == 1.0 else f"NO ({100 * match:.0f}%)"


def bench_table(results: dict[str, Any]):
    """What ``dmtp bench`` prints (a rich renderable, at most ``report.TABLE_WIDTH`` columns): one row per method
    with ``tok/s (×generate)`` per batch size and whether it was lossless, then a legend, one line per method (what
    it runs, or why it was skipped)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    batch_sizes = results["settings"]["batch_sizes"]
    sampled = bool(results["settings"].get("temperature"))
    repeats = results["settings"].get("repeats", 1)
    load = results["settings"].get("burner_cores")
    title = "dmtp bench: output tokens/s (× plain generate) per batch size, prefill included"
    title += f"; ± spread of {repeats} repeats" if repeats > 1 else ""
    title += f"; a CPU burner on {load} core{'s' if load != 1 else ''}" if load else ""
    period = results["settings"].get("burner_period")
    title += f", switched on and off every {period:g} s" if load and period else ""
    table = Table(title=title)
    table.add_column("method", no_wrap=True)
    for bs in batch_sizes:
        table.add_column(f"bs={bs}", justify="right", overflow="fold")
    table.add_column("lossless", justify="right", overflow="fold")
    for baseline in results["baselines"]:
        cells = []
        for bs in batch_sizes:
            entry = baseline["results"][str(bs)]
            tps, speedup = (entry["tokens_per_second"], entry["speedup"]) if entry else (None, None)
            cell = "n/a" if not tps else f"{tps:.1f} ({speedup:.2f}×)" if speedup else f"{tps:.1f}"
            if tps and entry.get("spread") is not None:
                cell += f" ±{100 * entry['spread'] / 2:.0f}%"
            cells.append(cell)
        table.add_row(baseline["name"], *cells, _lossless_cell(baseline, sampled))
    legend = [
        f"{b['name']}: " + (f"skipped: {b['skipped']}" if b["skipped"] else b["description"])
        for b in results["baselines"]
    ]
    legend.append(
        "lossless: every prompt's tokens equal plain generate's at batch size 1"
        + (" (not told at T > 0: sampled tokens may differ)" if sampled else "")
    )
    return Group(table, Text("\n".join(legend)))


def verify_costs(target, batch_sizes: list[int], max_width: int, progress: bool = True) -> dict[str, dict[str, float]]:
    """Seconds of one target forward over 1..``max_width`` tokens per batch size, as ``verify_length="auto"`` measures
    them (`widths.CostModel`): ``{batch: {width: seconds}}``. ``progress``: a bar on stderr, one step per width and
    batch size (minutes on a large target)."""
    from ..assistant.widths import CostModel

    costs = {}
    with tqdm(
        total=len(batch_sizes) * max_width,
        desc="measuring verify cost per width",
        unit="width",
        disable=not progress,
        dynamic_ncols=True,
    ) as bar:
        for b in batch_sizes:
            bar.set_postfix_str(f"bs={b}", refresh=False)
            done = bar.n
            measured = CostModel.measure(target, b, max_width, on_width=lambda _: bar.update())
            bar.update(done + max_width - bar.n)  # widths measured earlier (cached) count as done
            costs[str(b)] = {str(w): t for w, t in measured.verify.items()}
    return costs


def verify_cost_table(costs: dict[str, dict[str, float]]):
    """A rich ``Table``: milliseconds per verify width and batch size, and the ratio to a one-token step."""
    from rich.table import Table

    table = Table(title="target forward cost per width (what verify_length=auto weighs; ms, × a 1-token step)")
    table.add_column("width", justify="right")
    for batch in costs:
        table.add_column(f"bs={batch} ms", justify="right")
        table.add_column(f"bs={batch} ×1", justify="right")
    for width in next(iter(costs.values()), {}):
        cells = []
        for by_width in costs.values():
            cells += [f"{1000 * by_width[width]:.2f}", f"{by_width[width] / by_width['1']:.2f}"]
        table.add_row(width, *cells)
    return table


def plot_throughput(results: dict[str, Any], path: str | Path) -> Path:
    """Throughput vs batch size, one line (or point) per method that ran."""
    from .report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for baseline in results["baselines"]:
        points = [
            (int(bs), entry["tokens_per_second"])
            for bs, entry in baseline["results"].items()
            if entry and entry["tokens_per_second"]
        ]
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=baseline["name"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["settings"]["batch_sizes"], [str(b) for b in results["settings"]["batch_sizes"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title("End-to-end throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
