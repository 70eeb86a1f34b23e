"""Evaluation and benchmarking: the DMTP blog's acceptance protocol (``dmtp eval``), end-to-end throughput against
every baseline a user would pick (``dmtp bench``), model cards and Hub upload (``dmtp push``)."""

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
