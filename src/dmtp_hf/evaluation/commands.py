"""The ``dmtp eval``, ``dmtp bench`` and ``dmtp push`` subcommands (registered by :mod:`dmtp_hf.cli`).

Expected failures (bad paths, malformed prompt files, missing models) raise ``ValueError``/``OSError``; the
``dmtp`` entry point prints them as one line and exits with status 2. Building the parsers loads neither torch nor
Transformers (a fast ``dmtp --help``): the commands import what they run. Every default a help text states is read
from the value that sets it (``%(default)s`` or the constant itself).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .models import default_strategies_text
from .prompts import BUNDLED_SETS, DEFAULT_LIMIT


def _label_path(value: str) -> tuple[str, str]:
    label, sep, path = value.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {value!r}")
    return label, path


def _datasets(value: str) -> list[str]:
    if value == "all":
        return list(BUNDLED_SETS)
    if value == "none":
        return []
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in BUNDLED_SETS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown bundled set(s) {unknown}; choose from all, none, {list(BUNDLED_SETS)}"
        )
    return names


def _int_list(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _add_common(parser: argparse.ArgumentParser, default_output: str) -> None:
    models = parser.add_argument_group("models (omitted paths: the bundled trained models, when installed)")
    models.add_argument("--target", help="target checkpoint (with its native MTP head)")
    models.add_argument("--draft", help="DMTP draft checkpoint (strategy 'dmtp')")
    models.add_argument("--dflash-draft", help="DFlash draft checkpoint (strategy 'dflash')")
    models.add_argument(
        "--extra-draft",
        action="append",
        type=_label_path,
        default=[],
        metavar="LABEL=PATH",
        help="another DMTP/DFlash checkpoint compared under LABEL (PATH@HEAD: bound to head HEAD; repeatable)",
    )
    models.add_argument(
        "--mtp-head", help="MTP head checkpoint replacing the target's own (a tuned head, or a retrofitted one)"
    )
    models.add_argument(
        "--head",
        action="append",
        type=_label_path,
        default=[],
        metavar="LABEL=PATH",
        help="another MTP head, used by strategies mtpK@LABEL and drafts given as PATH@LABEL (repeatable)",
    )
    models.add_argument(
        "--bundle",
        default="bundled",
        choices=["bundled", "smollm2"],
        help="which bundled models fill omitted paths: the small Qwen3.5-style ones, or SmolLM2-135M-Instruct",
    )
    models.add_argument("--tokenizer", help="tokenizer path (default: the target's)")
    models.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    models.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--strategies",
        help="comma-separated: dmtp, dflash, mtp1..mtpK and --extra-draft labels "
        f"(default: {default_strategies_text()})",
    )
    work.add_argument(
        "--datasets",
        type=_datasets,
        default=list(BUNDLED_SETS),
        help=f"bundled prompt sets: all (default), none, or a comma list of {', '.join(BUNDLED_SETS)}",
    )
    work.add_argument(
        "--prompts", action="append", type=Path, default=[], metavar="PATH", help="extra prompt file (repeatable)"
    )
    work.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help="first N prompts of each set (default %(default)s)"
    )
    work.add_argument("--max-new-tokens", type=int, default=1024, help="per turn (default %(default)s)")
    work.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    work.add_argument(
        "--verify-mode",
        choices=["greedy", "match", "rejection", "block"],
        help="default: greedy at T=0, match otherwise",
    )
    work.add_argument(
        "--verify-length",
        type=_verify_length,
        default=None,
        help=(
            "candidates verified per round: a number (at most K), or auto (chosen per round from the draft's "
            "confidence and the measured cost of a verify; default: all K)"
        ),
    )
    work.add_argument("--no-chat-template", action="store_true", help="feed raw prompts (no chat template)")
    work.add_argument("--enable-thinking", action="store_true", help="render the chat template with thinking on")
    work.add_argument("--seed", type=int, default=0, help="default %(default)s")
    work.add_argument(
        "--fast-path",
        action="store_true",
        help="fixed-slot drafters (CUDA graphs on GPU for greedy rounds); same tokens as the default path",
    )
    parser.add_argument("--output-dir", type=Path, default=Path(default_output), help="default %(default)s")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_subcommands(sub) -> None:
    """Register ``eval``, ``bench`` and ``push`` on the ``dmtp`` subparsers."""
    evaluate = sub.add_parser(
        "eval", help="acceptance statistics of dmtp/dflash/mtp-k over prompt sets (the DMTP blog's protocol)"
    )
    _add_common(evaluate, "outputs/eval")
    evaluate.add_argument("--batch-size", type=int, default=1, help="speculative strategies support 1 for now")
    evaluate.add_argument(
        "--no-baseline", action="store_true", help="do not time plain target.generate (no speedup column)"
    )
    evaluate.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (default: as `dmtp demo` chooses, the cores free when the run starts; "
        "OMP_NUM_THREADS, when set, wins)",
    )
    evaluate.add_argument(
        "--report-only",
        nargs="+",
        type=Path,
        metavar="EVAL_JSON",
        help="rebuild JSON, markdown and plots from saved eval.json files into --output-dir; loads no model. "
        "Several files merge: disjoint prompt sets with the same strategies, or disjoint strategies on the same "
        "prompt sets (each column's speedup stays against the plain generate timed in its own run)",
    )
    evaluate.set_defaults(func=cmd_eval)

    bench = sub.add_parser(
        "bench",
        help="end-to-end throughput vs plain generate, prompt lookup, use_mtp, Transformers' DFlash, assisted decoding",
    )
    _add_common(bench, "outputs/bench")
    bench.add_argument(
        "--batch-sizes",
        type=_int_list,
        default="1",  # a string default goes through `type` like a typed value, and %(default)s shows it as typed
        help="e.g. 1,2,4 (default %(default)s; Transformers' assisted decoding: 1 only)",
    )
    bench.add_argument("--assistant", help="small assistant model for Transformers' assisted decoding")
    bench.add_argument(
        "--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (default %(default)s)"
    )
    bench.add_argument(
        "--repeats", type=int, default=1, help="repeat the workload (interleaved) N times (default %(default)s)"
    )
    bench.add_argument(
        "--burner",
        type=int,
        default=0,
        metavar="CORES",
        help="keep CORES cores busy with a CPU burner for the whole measurement, to time a loaded machine "
        "(stopped with the run; default %(default)s)",
    )
    bench.add_argument(
        "--burner-period",
        type=float,
        metavar="SECONDS",
        help="switch the burner on and off every SECONDS (a load that changes during the run; default: always on)",
    )
    bench.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (default: the cores free when the run starts, less the burner's, at least 1)",
    )
    bench.add_argument(
        "--compile",
        action="store_true",
        help="compile the target's verify forward (static cache, batch size 1) and add plain generate compiled",
    )
    bench.set_defaults(func=cmd_bench)

    calibrate = sub.add_parser(
        "calibrate",
        help="fit how often each draft's candidates are accepted at each confidence (for --verify-length auto)",
    )
    _add_common(calibrate, "outputs/calibrate")
    calibrate.add_argument(
        "--write", action="store_true", help="store each fit in its draft's config.json (what auto widths read)"
    )
    calibrate.add_argument("--bins", type=int, default=10, help="confidence bins per position (default %(default)s)")
    calibrate.add_argument(
        "--held-out",
        type=float,
        default=0.25,
        help=(
            "fraction of recorded candidates the reported Brier scores and reliability curves are computed on "
            "(fit on the rest; the stored fit uses all; default %(default)s)"
        ),
    )
    calibrate.set_defaults(func=cmd_calibrate)

    push = sub.add_parser("push", help="upload a DMTP checkpoint with a generated model card to the Hugging Face Hub")
    push.add_argument("checkpoint", type=Path)
    push.add_argument("repo_id", help="ORG/NAME")
    push.add_argument("--eval-json", type=Path, help="a `dmtp eval` eval.json whose tables go into the card")
    push.add_argument("--training-data", help="training data description for the card")
    push.add_argument("--target", help="target model id for the card (default: the eval's target)")
    push.add_argument("--private", action="store_true")
    push.add_argument("--revision", help="branch to push to")
    push.add_argument("--local-dir", type=Path, help="write the repo folder here (kept)")
    push.add_argument("--no-upload", action="store_true", help="only write the folder (needs --local-dir)")
    push.set_defaults(func=cmd_push)


def _verify_length(value: str) -> int | str:
    if value == "auto":
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"--verify-length takes a number or auto, not {value!r}")


def _settings(args: argparse.Namespace):
    from .acceptance import EvalSettings

    return EvalSettings(
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        verify_mode=args.verify_mode,
        chat_template=not args.no_chat_template,
        enable_thinking=args.enable_thinking,
        seed=args.seed,
        batch_size=getattr(args, "batch_size", 1),
        baseline=not getattr(args, "no_baseline", False),
        verify_length=args.verify_length,
    )


def _load(args: argparse.Namespace) -> dict[str, Any]:
    """Validate prompts, settings and model paths first (cheap, fails fast), then load target, tokenizer and
    strategies."""
    from .models import (
        build_strategies,
        load_tokenizer,
        parse_strategies,
        resolve_device_dtype,
        resolve_model_paths,
    )
    from .prompts import resolve_prompt_sets

    settings = _settings(args)
    prompt_sets = resolve_prompt_sets(args.datasets, args.prompts, settings.limit)
    paths = resolve_model_paths(
        args.target,
        args.draft,
        args.dflash_draft,
        tokenizer=args.tokenizer,
        extra_drafts=dict(args.extra_draft),
        mtp_head=args.mtp_head,
        heads=dict(args.head),
        bundle=args.bundle,
    )
    labels = parse_strategies(args.strategies, paths, extra_labels=[label for label, _ in args.extra_draft])
    from ..assistant.target.loading import load_target  # torch and Transformers: only once the paths are known

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    target = load_target(paths.target, dtype=dtype, device=device)
    tokenizer = load_tokenizer(paths.tokenizer or paths.target)
    strategies = build_strategies(labels, target, paths, fast_path=args.fast_path)
    return {
        "settings": settings,
        "prompt_sets": prompt_sets,
        "paths": paths,
        "target": target,
        "tokenizer": tokenizer,
        "strategies": strategies,
    }


def _console():
    from rich.console import Console

    from .report import TABLE_WIDTH

    # The tables are laid out for TABLE_WIDTH columns (a narrower terminal: its own width); stdout that is not a
    # terminal gets exactly that, not rich's 80, so nothing in a log is elided.
    return Console(width=min(TABLE_WIDTH, shutil.get_terminal_size((TABLE_WIDTH, 24)).columns))


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``dmtp calibrate``: decode the prompts verifying every candidate, fit acceptance against confidence per
    position for each draft strategy, print it, write ``calibration.json`` (and, with ``--write``, the drafts)."""
    from rich.table import Table

    from ..assistant.widths import Calibration
    from .acceptance import run_acceptance_eval
    from .calibration import CalibrationRecorder, plot_reliability, reliability, split_pairs, store_calibration

    args.verify_length = None
    loaded = _load(args)
    loaded["settings"].baseline = False
    drafts = [s for s in loaded["strategies"] if s.checkpoint is not None]
    if not drafts:
        raise ValueError("no strategy with a draft checkpoint to calibrate (MTP-k strategies store no calibration)")
    for strategy in drafts:
        strategy.verify_length = CalibrationRecorder(strategy.num_candidates)
    run_acceptance_eval(
        loaded["target"],
        loaded["tokenizer"],
        loaded["prompt_sets"],
        drafts,
        loaded["settings"],
        paths=loaded["paths"],
        progress=not args.no_progress,
    )
    report, curves, console = {}, {}, _console()
    for strategy in drafts:
        pairs = strategy.verify_length.pairs
        fit, held = split_pairs(pairs, args.held_out, seed=args.seed)
        rows = reliability(Calibration.fit(fit, num_bins=args.bins), held, args.bins)  # judged on held-out pairs
        calibration = Calibration.fit(pairs, num_bins=args.bins)  # what is stored: fitted on everything
        report[strategy.label] = {
            "checkpoint": strategy.checkpoint,
            "pairs": len(pairs),
            "held_out": len(held),
            **calibration.to_dict(),
            "positions": rows,
        }
        curves[strategy.label] = rows
        table = Table(title=f"{strategy.label}: P(accepted | confidence) per candidate position (held-out Brier)")
        for column in ("position", "tested", "accepted", "Brier raw", "Brier calibrated"):
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(
                str(row["position"]),
                str(row["tested"]),
                f"{100 * row['acceptance']:.1f}%",
                f"{row['brier_confidence']:.4f}",
                f"{row['brier_calibrated']:.4f}",
            )
        console.print(table)
        if args.write:
            console.print(f"wrote {store_calibration(strategy.checkpoint.partition('@')[0], calibration)}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {out / 'calibration.json'} and {plot_reliability(curves, out / 'reliability.png')}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``dmtp eval``: run the acceptance evaluation and write JSON, markdown and plots."""
    if args.report_only:
        from .merge import merge_eval_results

        parts = []
        for path in args.report_only:
            try:
                parts.append(json.loads(Path(path).read_text()))
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read eval results {path}: {err}") from None
        results = merge_eval_results(parts)
    else:
        if args.threads is not None and args.threads < 1:
            raise ValueError("--threads must be >= 1")
        loaded = _load(args)
        from ..machine import set_threads
        from .acceptance import run_acceptance_eval  # torch: after the cheap checks of `_load`

        # Measured after loading (an idle moment of this process): more threads than free cores would make every
        # speculative method crawl on a busy machine (0.43x plain generate with 2 threads vs 1.58x with 1).
        if args.threads is not None or "OMP_NUM_THREADS" not in os.environ:
            set_threads(args.threads)

        results = run_acceptance_eval(
            loaded["target"],
            loaded["tokenizer"],
            loaded["prompt_sets"],
            loaded["strategies"],
            loaded["settings"],
            paths=loaded["paths"],
            progress=not args.no_progress,
        )
    from .report import eval_table, write_eval_outputs

    files = write_eval_outputs(results, args.output_dir)
    console = _console()
    console.print(eval_table(results))
    for kind, path in files.items():
        console.print(f"wrote {kind}: {path}")
    return 0


def _bench_models(loaded: dict[str, Any], assistant: str | None) -> dict[str, Any]:
    """What a bench ran: the target, assistant, strategies and prompt sets (``bench.json["models"]``)."""
    return {
        "target": loaded["paths"].target,
        "assistant": assistant,
        "strategies": [s.describe() for s in loaded["strategies"]],
        "datasets": [
            {"name": s.name, "source": s.source, "num_prompts": len(s.prompts)} for s in loaded["prompt_sets"]
        ],
    }


def cmd_bench(args: argparse.Namespace) -> int:
    """``dmtp bench``: time every baseline side by side; print one table, write JSON and a plot."""
    import torch

    from ..assistant.target.loading import load_target
    from ..machine import Burner, set_threads
    from ..modeling.io import atomic_write_json
    from .acceptance import encode_conversation, generation_kwargs
    from .models import eos_token_ids
    from .throughput import (
        bench_table,
        build_baselines,
        plot_throughput,
        run_benchmark,
        verify_cost_table,
        verify_costs,
    )

    if args.prompt_lookup_tokens < 1:
        raise ValueError("--prompt-lookup-tokens must be >= 1")
    if args.burner < 0 or (args.threads is not None and args.threads < 1):
        raise ValueError("--burner must be >= 0 and --threads >= 1")
    # threads that do not oversubscribe: counted before the burner starts, which then takes its cores
    threads = set_threads(args.threads, reserved=args.burner)
    loaded = _load(args)
    target, tokenizer, settings = loaded["target"], loaded["tokenizer"], loaded["settings"]
    assistant = None
    if args.assistant:
        device = next(target.parameters()).device
        assistant = load_target(args.assistant, dtype=target.get_input_embeddings().weight.dtype, device=device)
    # First turns only: later turns depend on each method's own answers (identical at T=0, but not in general).
    prompts = [
        encode_conversation(tokenizer, [{"role": "user", "content": p.turns[0]}], settings)[0]
        for pset in loaded["prompt_sets"]
        for p in pset.prompts
    ]
    eos = eos_token_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    gen_kwargs = generation_kwargs(settings, eos, pad)
    baselines = build_baselines(
        target,
        loaded["strategies"],
        gen_kwargs,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        assistant=assistant,
        assistant_path=args.assistant,
        verify_mode=settings.resolved_verify_mode,
        verify_length=settings.verify_length,
        compile=args.compile,
    )
    models = _bench_models(loaded, args.assistant)
    out = Path(args.output_dir)

    def write(results: dict) -> None:  # after every batch size too: an interrupted run keeps what it measured
        results["settings"].update(threads=threads, burner_cores=args.burner, burner_period=args.burner_period)
        atomic_write_json(out / "bench.json", {**results, "models": models}, indent=1, allow_nan=False)

    with torch.no_grad(), Burner(args.burner, period=args.burner_period):
        results = run_benchmark(
            target,
            prompts,
            baselines,
            settings,
            batch_sizes=args.batch_sizes,
            eos=eos,
            pad_id=pad,
            repeats=args.repeats,
            progress=not args.no_progress,
            on_batch_size=write,
        )
        widest = 1 + max((s.num_candidates for s in loaded["strategies"]), default=7)
        results["verify_costs"] = verify_costs(target, args.batch_sizes, widest, progress=not args.no_progress)
    results["models"] = models
    write(results)
    plot = plot_throughput(results, out / "throughput.png")
    console = _console()
    console.print(bench_table(results))
    console.print(verify_cost_table(results["verify_costs"]))
    console.print(f"wrote json: {out / 'bench.json'}")
    console.print(f"wrote plot: {plot}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    """``dmtp push``: write config, safetensors, card (and eval JSON) into a folder and upload it."""
    from .hub import push_checkpoint

    if args.no_upload and args.local_dir is None:
        raise ValueError("--no-upload needs --local-dir (where to write the repo folder)")
    folder, info = push_checkpoint(
        args.checkpoint,
        args.repo_id,
        eval_json=args.eval_json,
        training_data=args.training_data,
        target=args.target,
        folder=args.local_dir,
        private=args.private,
        revision=args.revision,
        upload=not args.no_upload,
    )
    if info is None:
        print(f"wrote {folder} (not uploaded)")
    else:
        print(f"pushed {args.checkpoint} to {args.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0
