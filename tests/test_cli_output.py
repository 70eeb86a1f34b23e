"""What ``dmtp eval`` and ``dmtp bench`` tell a newcomer: help texts that state the defaults that run, tables that
fit 120 columns and say whether each method was lossless, progress for every long phase, methods named as they are.
"""

import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from dmtp_hf.cli import build_parser, main
from dmtp_hf.evaluation import commands
from dmtp_hf.evaluation import models as eval_models
from dmtp_hf.evaluation.models import DEFAULT_STRATEGIES, ModelPaths, Strategy, default_strategies_text
from dmtp_hf.evaluation.prompts import DEFAULT_LIMIT
from dmtp_hf.evaluation.report import TABLE_WIDTH, eval_table, lossless_by_strategy
from dmtp_hf.evaluation.throughput import bench_table, build_baselines, verify_cost_table, verify_costs

# The bundle's strategies: the defaults and the four extra drafts, the longest labels a table shows out of the box.
BUNDLE_LABELS = [*DEFAULT_STRATEGIES, "dmtp-native-head", "dmtp-from-dflash", "dflash2", "dmtp-d2"]
SETS = [("gsm8k", "GSM8K"), ("humaneval", "HumanEval"), ("math500", "MATH-500"), ("alpaca", "Alpaca")]


def help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_help_states_the_defaults_that_run(command, capsys):
    text = help_text(command, capsys)
    assert f"(default: {default_strategies_text()})" in text
    assert f"first N prompts of each set (default {DEFAULT_LIMIT})" in text
    args = build_parser().parse_args([command])
    assert args.strategies is None and args.limit == DEFAULT_LIMIT
    assert f"per turn (default {args.max_new_tokens})" in text and f"default outputs/{command}" in text
    if command == "bench":
        assert args.batch_sizes == [1] and "(default 1;" in text
        assert f"prompt_lookup_num_tokens (default {args.prompt_lookup_tokens})" in text


def test_default_strategies_are_the_three_named_plus_the_extra_drafts_given():
    paths = ModelPaths(target="t", draft="d", dflash_draft="f", extra_drafts={"bundled": "b", "mine": "m"})
    assert eval_models.parse_strategies(None, paths, extra_labels=[]) == list(DEFAULT_STRATEGIES)
    assert eval_models.parse_strategies(None, paths, extra_labels=["mine"]) == [*DEFAULT_STRATEGIES, "mine"]
    no_dflash = ModelPaths(target="t", draft="d")
    assert eval_models.parse_strategies(None, no_dflash, extra_labels=[]) == [
        s for s in DEFAULT_STRATEGIES if s != "dflash"
    ]
    # as a library call without extra_labels: every extra draft, as before
    assert eval_models.parse_strategies(None, paths) == [*DEFAULT_STRATEGIES, "bundled", "mine"]


def test_eval_on_the_bundle_runs_the_default_its_help_names(monkeypatch, capsys):
    """The issue: seven strategies ran where the help named three. The bundle's extra drafts run when named."""
    ran = []
    parse = eval_models.parse_strategies

    def stop_after_parsing(*args, **kwargs):
        ran.append(parse(*args, **kwargs))
        raise ValueError("stop before loading models")

    monkeypatch.setattr(eval_models, "parse_strategies", stop_after_parsing)
    assert main(["eval", "--datasets", "gsm8k", "--limit", "1", "--no-progress"]) == 2
    assert ran == [list(DEFAULT_STRATEGIES)]
    assert main(["eval", "--datasets", "gsm8k", "--extra-draft", "x=somewhere", "--no-progress"]) == 2
    assert ran[-1] == [*DEFAULT_STRATEGIES, "x"]
    capsys.readouterr()


def _entry(digest: str, rounds: int = 10) -> dict:
    return {
        "num_rounds": rounds,
        "acceptance_length_per_request": 5.123,
        "acceptance_length_per_verify": 5.456,
        "first_candidate_acceptance": 0.9521,
        "speedup": 2.13,
        "output_digest": digest,
    }


def eval_results(labels: list[str], temperature: float = 0.0, baseline: bool = True) -> dict:
    """A ``dmtp eval`` result: ``mtp4`` differs from plain generate on Alpaca, ``dflash2`` ran no round on GSM8K."""
    results = {
        name: {
            label: _entry("other" if (label, name) == ("mtp4", "alpaca") else "same", 0 if label == "dflash2" else 9)
            for label in labels
        }
        for name, _ in SETS
    }
    return {
        "settings": {"temperature": temperature},
        "strategies": [{"label": label, "kind": "dmtp", "num_candidates": 7} for label in labels],
        "datasets": [{"name": name, "display_name": display} for name, display in SETS],
        "results": results,
        "overall": {label: _entry("n/a") for label in labels},
        "baseline": {name: {"output_digest": "same"} for name, _ in SETS} if baseline else {},
    }


def bench_results(batch_sizes: list[int], temperature: float = 0.0) -> dict:
    names = ["generate", *BUNDLE_LABELS, "prompt_lookup", "hf_use_mtp", "assisted", "generate_compiled"]
    baselines = []
    for name in names:
        match = 0.75 if name == "prompt_lookup" else 1.0
        measured = {"tokens_per_second": 12345.6, "speedup": 12.85, "matches_generate": match}
        baselines.append(
            {
                "name": name,
                "description": "DMTP (native MTP T1 + DFlash T2..), 7 candidates, verify_length=auto, compiled verify",
                "skipped": "Transformers' assisted decoding refuses stateful (linear-attention) targets " * 2
                if name == "assisted"
                else None,
                "results": {str(bs): None if name == "assisted" else measured for bs in batch_sizes},
            }
        )
    return {"settings": {"batch_sizes": batch_sizes, "temperature": temperature}, "baselines": baselines}


def render(*renderables, width: int) -> list[str]:
    buffer = io.StringIO()
    console = Console(width=width, file=buffer)
    for renderable in renderables:
        console.print(renderable)
    return buffer.getvalue().splitlines()


def test_eval_table_fits_120_columns_and_says_which_strategy_was_lossless():
    results = eval_results(BUNDLE_LABELS)
    # laid out to fit: even on a console twice as wide, no line is longer and no label is elided
    lines = render(eval_table(results), width=2 * TABLE_WIDTH)
    assert max(len(line) for line in lines) <= TABLE_WIDTH and "…" not in "\n".join(lines)
    header = next(line for line in lines if "strategy" in line)
    assert "lossless" in header
    cells, dataset = {}, ""
    for line in lines:
        parts = [p.strip() for p in line.split("│")]
        if len(parts) > 2 and parts[2] in BUNDLE_LABELS:
            dataset = parts[1] or dataset
            cells[dataset, parts[2]] = parts[-2]
    assert set(label for _, label in cells) == set(BUNDLE_LABELS)  # every label in full
    assert cells["Alpaca", "mtp4"] == "NO" and cells["All", "mtp4"] == "NO"
    assert cells["GSM8K", "mtp4"] == "yes" and cells["All", "dmtp-from-dflash"] == "yes"
    assert any("no rounds" in line and "dflash2" in line for line in lines)
    # where it cannot be told: no plain generate ran, or sampled decoding
    for unknown in (eval_results(BUNDLE_LABELS, baseline=False), eval_results(BUNDLE_LABELS, temperature=0.7)):
        assert {v for by_set in lossless_by_strategy(unknown).values() for v in by_set.values()} == {None}


def test_bench_tables_fit_120_columns_with_a_lossless_column_and_a_legend(monkeypatch):
    results = bench_results([1, 2, 4, 8])
    table, legend = bench_table(results).renderables
    assert max(len(line) for line in render(table, width=2 * TABLE_WIDTH)) <= TABLE_WIDTH
    monkeypatch.setenv("COLUMNS", "300")  # a wide terminal: the command still prints TABLE_WIDTH columns
    console = commands._console()
    assert console.width == TABLE_WIDTH
    costs = {str(bs): {str(w): 0.001 * w for w in range(1, 9)} for bs in (1, 2, 4, 8)}
    lines = render(bench_table(results), verify_cost_table(costs), width=console.width)
    assert max(len(line) for line in lines) <= TABLE_WIDTH and "…" not in "\n".join(lines)
    rows = {p[1].strip(): p[-2].strip() for p in (line.split("│") for line in lines) if len(p) > 2}
    assert rows["generate"] == "reference" and rows["dmtp-native-head"] == "yes"
    assert rows["prompt_lookup"] == "NO (75%)" and rows["assisted"] == "n/a"
    text = "\n".join(lines)
    assert re.search(r"^assisted: skipped: Transformers' assisted", text, re.MULTILINE)
    assert re.search(r"^dmtp-native-head: DMTP \(native MTP T1", text, re.MULTILINE)
    sampled = render(bench_table(bench_results([1], temperature=0.7)), width=TABLE_WIDTH)
    assert "NO" not in "\n".join(sampled) and "T > 0" in "\n".join(sampled)


def test_verify_costs_report_progress_per_width(target, capsys):
    costs = verify_costs(target, [1, 2], 3, progress=True)
    assert list(costs) == ["1", "2"] and all(list(by_width) == ["1", "2", "3"] for by_width in costs.values())
    err = capsys.readouterr().err
    assert "measuring verify cost per width" in err and "6/6" in err
    verify_costs(target, [1, 2], 3, progress=True)  # measured before (cached): the bar still ends full
    assert "6/6" in capsys.readouterr().err
    verify_costs(target, [1], 3, progress=False)
    assert capsys.readouterr().err == ""


def test_bench_names_dflash2_as_dflash2(target):
    drafter = SimpleNamespace(num_candidates=7)
    strategies = [
        Strategy("dflash2", "dflash", drafter, "path", {"backbone": "dflash2"}),
        Strategy("dflash", "dflash", drafter, "path", {"backbone": "dflash"}),
        Strategy("dmtp-d2", "dmtp", drafter, "path", {"backbone": "dflash2"}),
        Strategy("mtp4", "mtp", SimpleNamespace(num_candidates=4), None, {}),
    ]
    described = {b.name: b.description for b in build_baselines(target, strategies, {"max_new_tokens": 4})}
    assert described["dflash2"] == "our DFlash2, 7 candidates"
    assert described["dflash"] == "our DFlash, 7 candidates"
    assert described["dmtp-d2"] == "DMTP (native MTP T1 + DFlash2 T2..), 7 candidates"
    assert described["mtp4"] == "our native MTP, 4 candidates"
