"""Evaluation and benchmarking: the DMTP blog's acceptance protocol (``dmtp eval``), end-to-end throughput against
every baseline a user would pick (``dmtp bench``), model cards and Hub upload (``dmtp push``).

The names load on first use (PEP 562): the ``dmtp`` parser (:mod:`.commands`) imports this package without loading
torch or Transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(("EvalSettings", "encode_conversation", "run_acceptance_eval"), "acceptance"),
    **dict.fromkeys(("card_template_text", "prepare_repo_folder", "push_checkpoint", "render_model_card"), "hub"),
    **dict.fromkeys(
        ("ModelPaths", "Strategy", "build_strategies", "parse_strategies", "resolve_model_paths"), "models"
    ),
    **dict.fromkeys(
        (
            "BUNDLED_SETS",
            "BenchPrompt",
            "PromptFileError",
            "PromptSet",
            "bundled_data_dir",
            "load_bundled_set",
            "load_prompt_file",
            "resolve_prompt_sets",
        ),
        "prompts",
    ),
    **dict.fromkeys(("markdown_report", "write_eval_outputs"), "report"),
    **dict.fromkeys(("Baseline", "bench_table", "build_baselines", "plot_throughput", "run_benchmark"), "throughput"),
}

if TYPE_CHECKING:
    from .acceptance import EvalSettings, encode_conversation, run_acceptance_eval
    from .hub import card_template_text, prepare_repo_folder, push_checkpoint, render_model_card
    from .models import ModelPaths, Strategy, build_strategies, parse_strategies, resolve_model_paths
    from .prompts import (
        BUNDLED_SETS,
        BenchPrompt,
        PromptFileError,
        PromptSet,
        bundled_data_dir,
        load_bundled_set,
        load_prompt_file,
        resolve_prompt_sets,
    )
    from .report import markdown_report, write_eval_outputs
    from .throughput import Baseline, bench_table, build_baselines, plot_throughput, run_benchmark


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access (and keep the value here)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own names and the lazily loaded public ones."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BUNDLED_SETS",
    "Baseline",
    "BenchPrompt",
    "EvalSettings",
    "ModelPaths",
    "PromptFileError",
    "PromptSet",
    "Strategy",
    "bench_table",
    "build_baselines",
    "build_strategies",
    "bundled_data_dir",
    "card_template_text",
    "encode_conversation",
    "load_bundled_set",
    "load_prompt_file",
    "markdown_report",
    "parse_strategies",
    "plot_throughput",
    "prepare_repo_folder",
    "push_checkpoint",
    "render_model_card",
    "resolve_model_paths",
    "resolve_prompt_sets",
    "run_acceptance_eval",
    "run_benchmark",
    "write_eval_outputs",
]
