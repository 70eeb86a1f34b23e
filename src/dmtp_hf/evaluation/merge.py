"""Merging ``dmtp eval`` results run separately (``dmtp eval --report-only A.json B.json``).

Two shapes merge, as if run together:

- **rows**: disjoint prompt sets with the same strategies (e.g. parallel worker processes, one set each);
- **columns**: the same prompt sets with disjoint strategies (e.g. a draft trained later, evaluated on its own).
  Each column keeps the plain-``generate`` timing of the run it came from (``column_baselines``), so its speedup is
  still measured against a baseline timed next to it; at T = 0 both runs' baselines must have produced the same
  tokens, which checks that they ran the same target on the same prompts.
"""

from __future__ import annotations

from typing import Any

from .acceptance import SCHEMA, finalize_results

# Keys of ``settings`` that may differ between row parts: ``limit`` (a worker may cap its sets), and the measured
# start-up time that older files kept under ``settings``.
_ROW_IGNORED_SETTINGS = frozenset({"limit", "auto_cost_measure_seconds"})


def merge_eval_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge ``dmtp eval`` results of disjoint prompt sets (same strategies and settings), or of disjoint strategies
    on the same prompt sets and settings, into one result, as if run together."""
    if not parts:
        raise ValueError("nothing to merge")
    for part in parts:
        if part.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file (schema {part.get('schema')!r})")
        if bool(part.get("baseline")) != bool(parts[0].get("baseline")):
            raise ValueError("cannot merge evaluations with and without the generate baseline")
    # the same sets in any order (parallel workers may have run them in another order)
    same_sets = all(sorted(_dataset_names(part)) == sorted(_dataset_names(parts[0])) for part in parts)
    labels = [label for part in parts for label in _labels(part)]
    if len(parts) > 1 and same_sets and len(labels) == len(set(labels)):
        merged = _merge_columns(parts)
    else:
        merged = _merge_rows(parts)
    merged["auto_cost_measure_seconds"] = sum(_auto_cost_seconds(part) for part in parts)
    return finalize_results(merged)


def _merge_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    first = parts[0]
    labels = _labels(first)
    merged = {**first, "datasets": [], "results": {}, "baseline": {}, "outputs_identical": {}}
    for part in parts:
        if _labels(part) != labels:
            raise ValueError("cannot merge evaluations of different strategies (and overlapping prompt sets)")
        if _settings(part, _ROW_IGNORED_SETTINGS) != _settings(first, _ROW_IGNORED_SETTINGS):
            raise ValueError("cannot merge evaluations run with different settings")
        if part.get("column_baselines"):
            raise ValueError("merge prompt sets before adding columns from another run")
        for dataset in part["datasets"]:
            name = dataset["name"]
            if name in merged["results"]:
                raise ValueError(f"dataset {name!r} appears in more than one file")
            merged["datasets"].append(dataset)
            merged["results"][name] = part["results"][name]
            if part.get("baseline"):
                merged["baseline"][name] = part["baseline"][name]
            merged["outputs_identical"][name] = part["outputs_identical"][name]
    merged["settings"] = _settings(first, _ROW_IGNORED_SETTINGS) | {"limit": first["settings"].get("limit")}
    return merged


def _merge_columns(parts: list[dict[str, Any]]) -> dict[str, Any]:
    first = parts[0]
    ignored = frozenset({"auto_cost_measure_seconds"})
    for part in parts[1:]:
        if _settings(part, ignored) != _settings(first, ignored):
            raise ValueError("cannot merge evaluations run with different settings")
        if _prompt_counts(part) != _prompt_counts(first):
            raise ValueError("cannot add columns evaluated on a different number of prompts")
    names = _dataset_names(first)
    merged = {
        **first,
        "settings": _settings(first, ignored),
        "strategies": [s for part in parts for s in part["strategies"]],
        "results": {name: {k: v for part in parts for k, v in part["results"][name].items()} for name in names},
        "column_baselines": dict(first.get("column_baselines") or {}),
    }
    greedy = not first["settings"].get("temperature")
    for part in parts[1:]:
        own = part.get("column_baselines") or {}
        for label in _labels(part):
            timing = own.get(label) or part.get("baseline")
            if timing:
                merged["column_baselines"][label] = {
                    name: {k: timing[name][k] for k in ("output_tokens", "wall_seconds", "output_digest")}
                    for name in names
                }
        if greedy and first.get("baseline"):
            for name in names:
                if part["baseline"][name]["output_digest"] != first["baseline"][name]["output_digest"]:
                    raise ValueError(
                        f"plain generate produced different tokens on {name!r} in the two runs: not the same "
                        "target, prompts or settings"
                    )
    merged["outputs_identical"] = {name: all(part["outputs_identical"][name] for part in parts) for name in names}
    if not merged["column_baselines"]:
        del merged["column_baselines"]
    return merged


def _labels(part: dict[str, Any]) -> list[str]:
    return [s["label"] for s in part["strategies"]]


def _prompt_counts(part: dict[str, Any]) -> dict[str, int]:
    return {d["name"]: d["num_prompts"] for d in part["datasets"]}


def _dataset_names(part: dict[str, Any]) -> list[str]:
    return [d["name"] for d in part["datasets"]]


def _settings(part: dict[str, Any], ignored: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in part["settings"].items() if k not in ignored}


def _auto_cost_seconds(part: dict[str, Any]) -> float:
    """The seconds a part spent timing the target per width for ``auto`` (top level; older files: in settings)."""
    return float(part.get("auto_cost_measure_seconds", part["settings"].get("auto_cost_measure_seconds")) or 0.0)
