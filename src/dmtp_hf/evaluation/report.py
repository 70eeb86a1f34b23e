"""Reports of ``dmtp eval``: a markdown page shaped like the DMTP blog's tables and matplotlib plots (Agg).

Everything here reads only the results JSON (:func:`~dmtp_hf.evaluation.acceptance.run_acceptance_eval`), so a
report can be regenerated from a saved file (``dmtp eval --report-only results.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ALL = "overall"
# The widest a printed table may be (`dmtp eval`, `dmtp bench`, `dmtp calibrate`): the tables are laid out to fit it,
# and a cell wider than its share wraps instead of being cut short.
TABLE_WIDTH = 120


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _rel(new: float | None, base: float | None) -> str:
    if new is None or base is None or base == 0:
        return "n/a"
    return f"{100 * (new / base - 1):+.2f}%"


def _pp(new: float | None, base: float | None) -> str:
    return "n/a" if new is None or base is None else f"{100 * (new - base):+.2f}"


def dataset_rows(results: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(key, display name, {strategy: entry})`` per dataset, then the all-datasets row."""
    rows = [(d["name"], d["display_name"], results["results"][d["name"]]) for d in results["datasets"]]
    if len(rows) > 1:
        rows.append((ALL, "All", results["overall"]))
    return rows


def comparison_pairs(results: dict[str, Any]) -> list[tuple[str, str]]:
    """``(dmtp-kind label, dflash label)`` pairs for the "vs DFlash" columns (first DFlash strategy)."""
    kinds = {s["label"]: s["kind"] for s in results["strategies"]}
    dflash = [label for label, kind in kinds.items() if kind == "dflash"]
    if not dflash:
        return []
    return [(label, dflash[0]) for label, kind in kinds.items() if kind == "dmtp"]


def lossless_by_strategy(results: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    """``{strategy: {dataset key (and ALL): lossless}}``: whether every output of the strategy equalled plain
    ``generate``'s, token for token (the ``output_digest`` of each, timed in the same run). ``None`` where it cannot
    be told: no plain ``generate`` ran (``--no-baseline``), or sampled decoding (T > 0), whose tokens may differ while
    the distribution is the same."""
    sampled = bool(results["settings"].get("temperature"))
    column_baselines = results.get("column_baselines") or {}
    out: dict[str, dict[str, bool | None]] = {}
    for strategy in results["strategies"]:
        label = strategy["label"]
        baseline = column_baselines.get(label) or results.get("baseline") or {}
        by_dataset: dict[str, bool | None] = {}
        for dataset in results["datasets"]:
            name = dataset["name"]
            ours = results["results"][name][label].get("output_digest")
            reference = baseline.get(name, {}).get("output_digest")
            by_dataset[name] = None if sampled or ours is None or reference is None else ours == reference
        values = list(by_dataset.values())
        by_dataset[ALL] = None if None in values else all(values)
        out[label] = by_dataset
    return out


def _yes_no(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "NO")


def eval_table(results: dict[str, Any]):
    """The table ``dmtp eval`` prints (a rich ``Table``, at most :data:`TABLE_WIDTH` columns): one row per dataset
    and strategy, so that neither many strategies nor long labels widen it; then a caption saying what each column
    is."""
    from rich.table import Table

    lossless = lossless_by_strategy(results)
    table = Table(
        title="dmtp eval: acceptance length per request (τ), first-candidate acceptance, speedup, lossless",
        caption="τ: tokens committed per verify round (mean over requests; over all rounds) · T1: rounds whose first "
        "candidate was accepted · speedup: tokens/s over plain generate's in the same run · lossless: every output "
        "equal to plain generate's, token for token (n/a: no plain generate, or T > 0)",
        caption_justify="left",
    )
    for name, justify in [("dataset", "left"), ("strategy", "left")] + [
        (name, "right") for name in ("τ per request", "τ per verify", "T1 accepted", "speedup", "lossless")
    ]:
        table.add_column(name, justify=justify, overflow="fold")
    labels = [s["label"] for s in results["strategies"]]
    for key, display, entries in dataset_rows(results):
        for index, label in enumerate(labels):
            e = entries[label]
            rounds = bool(e["num_rounds"])
            table.add_row(
                display if index == 0 else "",
                label,
                _fmt(e["acceptance_length_per_request"]) if rounds else "no rounds",
                _fmt(e["acceptance_length_per_verify"]) if rounds else "—",
                f"{100 * e['first_candidate_acceptance']:.1f}%" if rounds else "—",
                f"{_fmt(e.get('speedup'), 2)}×" if e.get("speedup") is not None else "n/a",
                _yes_no(lossless[label][key]),
                end_section=index == len(labels) - 1,
            )
    return table


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _metric_table(results: dict[str, Any], metric: str, fmt, diff) -> list[str]:
    labels = [s["label"] for s in results["strategies"]]
    pairs = comparison_pairs(results)
    header = ["Dataset", *labels, *[f"{a} vs. {b}" for a, b in pairs]]
    rows = []
    for _, display, entries in dataset_rows(results):
        row = [display, *[fmt(entries[label][metric]) for label in labels]]
        row += [diff(entries[a][metric], entries[b][metric]) for a, b in pairs]
        rows.append(row)
    return _table(header, rows)


def _position_table(results: dict[str, Any], metric: str) -> list[str]:
    width = max(s["num_candidates"] for s in results["strategies"])
    header = ["Dataset / strategy", "Verify rounds", *[f"T{k}" for k in range(1, width + 1)]]
    rows = []
    for _, display, entries in dataset_rows(results):
        for strategy in results["strategies"]:
            entry = entries[strategy["label"]]
            values = [_pct(v) for v in entry[metric]] + ["—"] * (width - len(entry[metric]))
            rows.append([f"{display} / {strategy['label']}", str(entry["num_rounds"]), *values])
    return _table(header, rows)


def _speedup_table(results: dict[str, Any]) -> list[str]:
    labels = [s["label"] for s in results["strategies"]]
    baseline = results["baseline"]
    header = ["Dataset", "generate tok/s", *labels]
    rows = []
    for key, display, entries in dataset_rows(results):
        row = [display, _fmt(baseline[key].get("tokens_per_second"), 1)]
        row += [
            f"{_fmt(entries[label].get('speedup'), 2)}× ({_fmt(entries[label].get('tokens_per_second'), 1)})"
            for label in labels
        ]
        rows.append(row)
    return _table(header, rows)


def markdown_report(results: dict[str, Any]) -> str:
    """The evaluation as markdown: settings, then per-request / per-verify acceptance length, first-candidate
    acceptance and position-wise (cumulative and conditional) acceptance, in the blog's table shapes."""
    settings, models = results["settings"], results["models"]
    strategies = ", ".join(
        f"`{s['label']}` ({s['kind']}, {s['num_candidates']} candidate{'s' if s['num_candidates'] != 1 else ''}"
        + (f", {s['anchor_layout']}/{s['fusion']}" if s["kind"] == "dmtp" else "")
        + ")"
        for s in results["strategies"]
    )
    limit = settings["limit"] if settings["limit"] is not None else "all"
    chat = "target chat template" if settings["chat_template"] else "raw prompts (no chat template)"
    thinking = "thinking enabled" if settings["enable_thinking"] else "thinking disabled"
    lines = [
        "# DMTP acceptance evaluation",
        "",
        f"- Target: `{models.get('target')}` ({models.get('target_model_type')}, {models.get('dtype')})",
        f"- Strategies: {strategies}",
        f"- Protocol: first {limit} prompts per set, {chat}, {thinking}, T={settings['temperature']:g} "
        f"({settings['verify_mode']} verification), up to {settings['max_new_tokens']} new tokens per turn, "
        "stop at EOS; multi-turn sets answered turn by turn with each strategy's own previous answers (one request "
        "per turn).",
        f"- Environment: {', '.join(f'{k} {v}' for k, v in results['environment'].items())}",
        "",
        "## Acceptance length per request",
        "",
        "Mean over requests of committed tokens per verify round (target correction/bonus token included).",
        "",
        *_metric_table(results, "acceptance_length_per_request", _fmt, _rel),
        "",
        "## Acceptance length per verify",
        "",
        "`1 + Σ k·hist[k] / Σ hist[k]` over all verify rounds.",
        "",
        *_metric_table(results, "acceptance_length_per_verify", _fmt, _rel),
        "",
        "## First-candidate acceptance",
        "",
        "`1 − hist[0] / Σ hist[k]` over verify rounds; differences in percentage points.",
        "",
        *_metric_table(results, "first_candidate_acceptance", _pct, _pp),
        "",
        "## Cumulative position-wise acceptance P(L ≥ k)",
        "",
        *_position_table(results, "cumulative_acceptance"),
        "",
        "## Conditional position-wise acceptance P(L ≥ k | L ≥ k−1)",
        "",
        *_position_table(results, "conditional_acceptance"),
        "",
    ]
    if results.get("baseline"):
        env = results["environment"]
        lines += [
            "## Wall-clock speedup over plain `target.generate`",
            "",
            f"Output tokens per second of the whole workload (prefill included) relative to plain decoding of the "
            f"same turns, timed in the same run, batch size 1, on {env.get('device', 'the device')}: "
            "`speedup (tokens/s)`.",
            "",
            *_speedup_table(results),
            "",
        ]
        if results.get("column_baselines"):
            separate = ", ".join(f"`{label}`" for label in results["column_baselines"])
            lines += [
                f"{separate} ran in a separate run, against the plain `generate` timed in that run (its tokens/s "
                "are in `column_baselines` of eval.json).",
                "",
            ]
    mismatched = [name for name, same in results.get("outputs_identical", {}).items() if not same]
    if mismatched and not settings["temperature"]:
        lines += [
            f"> Note: at T=0 the strategies' outputs differ on {', '.join(mismatched)} (expected identical; "
            "reduced-precision numerics can flip near-ties).",
            "",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance_length(results: dict[str, Any], path: Path) -> Path:
    """Grouped bars: per-request acceptance length per dataset, one bar per strategy, values on top."""
    plt = _pyplot()
    rows = dataset_rows(results)
    labels = [s["label"] for s in results["strategies"]]
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) * max(1, len(labels) / 3)), 4.0))
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(rows))]
        values = [entries[label]["acceptance_length_per_request"] or 0.0 for _, _, entries in rows]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(rows)), [display for _, display, _ in rows])
    ax.set_ylabel("acceptance length per request")
    ax.set_title("Mean acceptance length (bonus token included)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _grid(count: int):
    plt = _pyplot()
    cols = min(3, count)
    nrows = (count + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    return plt, fig, list(axes.flat[:count])


def plot_position_acceptance(results: dict[str, Any], path: Path) -> Path:
    """Cumulative position-wise acceptance ``P(L >= k)`` per dataset, one line per strategy."""
    rows = dataset_rows(results)
    plt, fig, axes = _grid(len(rows))
    for ax, (_, display, entries) in zip(axes, rows):
        for strategy in results["strategies"]:
            values = [v if v is not None else float("nan") for v in entries[strategy["label"]]["cumulative_acceptance"]]
            ax.plot(range(1, len(values) + 1), values, marker="o", label=strategy["label"])
        ax.set_title(display)
        ax.set_xlabel("k (draft position)")
        ax.set_ylabel("P(L ≥ k)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_histogram(results: dict[str, Any], path: Path) -> Path:
    """Fraction of verify rounds accepting exactly k candidates, per dataset, grouped by strategy."""
    rows = dataset_rows(results)
    plt, fig, axes = _grid(len(rows))
    labels = [s["label"] for s in results["strategies"]]
    width = 0.8 / max(len(labels), 1)
    for ax, (_, display, entries) in zip(axes, rows):
        for i, label in enumerate(labels):
            hist = entries[label]["hist"]
            total = sum(hist) or 1
            xs = [k + (i - (len(labels) - 1) / 2) * width for k in range(len(hist))]
            ax.bar(xs, [c / total for c in hist], width, label=label)
        ax.set_title(display)
        ax.set_xlabel("accepted candidates k")
        ax.set_ylabel("fraction of rounds")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_eval_outputs(results: dict[str, Any], output_dir: str | Path) -> dict[str, Path]:
    """Write ``eval.json``, ``eval.md`` and the three PNG plots into ``output_dir``; returns their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "eval.json", "markdown": out / "eval.md"}
    files["json"].write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    files["markdown"].write_text(markdown_report(results))
    files["acceptance_plot"] = plot_acceptance_length(results, out / "acceptance_length.png")
    files["position_plot"] = plot_position_acceptance(results, out / "position_acceptance.png")
    files["histogram_plot"] = plot_histogram(results, out / "acceptance_histogram.png")
    return files
