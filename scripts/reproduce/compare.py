"""A bundle's comparison, one command: native MTP-1..4, DFlash and the DMTP drafts on the same prompts.

    python scripts/reproduce/compare.py                       # reports/bundled/: README.md, JSON, PNG plots
    python scripts/reproduce/compare.py --bundle smollm2      # reports/smollm2/ (SmolLM2-135M-Instruct)
    python scripts/reproduce/compare.py --limit 4 --max-new-tokens 16 --output-dir /tmp/smoke   # quick smoke run

1. ``dmtp eval`` on held-out code requests, held-out chats (``outputs/corpus/bench``, rebuilt by
   ``build_corpus.py``) and MT-Bench (two turns, out of distribution; SmolLM2 adds GSM8K, in distribution),
   ``--limit`` prompts each: acceptance length per request and per verify, first-candidate acceptance, position-wise
   acceptance, and wall-clock speedup over plain ``target.generate`` timed on the same turns. The prompt sets are
   split over ``--workers`` single-threaded processes (each times its own baseline, so every ratio is measured under
   one process's conditions) and merged
   with ``dmtp eval --report-only``.
2. ``dmtp bench`` on the first-turn prompts of code and MT-Bench at batch sizes 1, 2, 4, 8 (``--batch-sizes``).
3. ``README.md``: the summary table (per workload and method), DMTP vs DFlash, parameter budgets, training budget,
   and the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "assets" / "dmtp_hf_assets" / "models"
BENCH = REPO / "outputs" / "corpus" / "bench"


@dataclass
class Bundle:
    """What a bundle's comparison runs: eval/bench model arguments, methods, drafts (label -> folder) to describe,
    and the DMTP variants compared with DFlash."""

    title: str
    models: list[str]
    methods: list[str]
    bench_methods: list[str]
    drafts: dict[str, Path]
    dmtp_variants: list[str]
    heads: dict[str, Path] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=lambda: ["mt_bench"])  # bundled sets next to the held-out files
    # the blog's section 8 columns: (column name, method label); the table is shown when every label was run
    blog_columns: list[tuple[str, str]] = field(default_factory=lambda: list(BLOG_COLUMNS))
    # with two eval workers: what each runs, (bundled sets, held-out prompt files); None: the bundled sets in one,
    # the held-out files in the other
    eval_split: list[tuple[list[str], list[str]]] | None = None
    # dmtp bench runs, one per group of workloads: (name, bundled sets, held-out prompt files)
    bench_groups: list[tuple[str, list[str], list[str]]] = field(
        default_factory=lambda: [("MT-Bench and held-out code", ["mt_bench"], ["held-out-code"])]
    )


def bundle(name: str) -> Bundle:
    """The comparison of the ``bundled`` or ``smollm2`` models."""
    if name == "smollm2":
        folder = MODELS / "smollm2"
        drafts = {"dmtp": folder / "dmtp", "dflash": folder / "dflash"}
        methods, variants = ["mtp1", "mtp4", "dflash", "dmtp"], ["dmtp"]
        # the DFlash2 backbone and DMTP(D2) on it, each once trained and bundled
        d2 = {"dflash2": folder / "dflash2", "dmtp-d2": folder / "dmtp_d2"}
        d2 = {name: path for name, path in d2.items() if (path / "config.json").is_file()}
        drafts.update(d2)
        methods += list(d2)
        variants += [name for name in d2 if name == "dmtp-d2"]
        return Bundle(
            title="SmolLM2-135M-Instruct (a real pretrained target) with a retrofitted MTP head",
            models=["--bundle", "smollm2"],
            # fixed K, then the adaptive width of the two block drafters (compare tau only at a fixed width)
            methods=[*methods, "dmtp:auto", "dflash:auto"],
            bench_methods=["dmtp", "dmtp:auto", "dflash", "mtp1", *d2],
            drafts=drafts,
            dmtp_variants=variants,
            heads={"retrofitted MTP head": folder / "mtp_head"},
            datasets=["gsm8k", "humaneval", "mt_bench", "alpaca"],  # the blog's section 8 sets
            # about equal halves of plain generate's time (MT-Bench, two turns a prompt, is a third of the whole)
            eval_split=[(["gsm8k", "mt_bench"], []), (["humaneval", "alpaca"], ["held-out-code", "held-out-chat"])],
            blog_columns=[
                ("MTP-4", "mtp4"),
                ("DFlash", "dflash"),
                ("DMTP(D)", "dmtp"),
                ("DFlash2", "dflash2"),
                ("DMTP(D2)", "dmtp-d2"),
            ],
            # speedup per workload at every batch size: the math/code goal and the chat goal
            bench_groups=[
                ("GSM8K and HumanEval", ["gsm8k", "humaneval"], []),
                ("MT-Bench, Alpaca and held-out chat", ["mt_bench", "alpaca"], ["held-out-chat"]),
            ],
        )
    drafts = {"dmtp": MODELS / "dmtp", "dflash": MODELS / "dflash", "dmtp-from-dflash": MODELS / "dmtp_from_dflash"}
    models = [
        "--target",
        str(MODELS / "target"),
        "--draft",
        str(drafts["dmtp"]),
        "--dflash-draft",
        str(drafts["dflash"]),
        "--extra-draft",
        f"dmtp-from-dflash={drafts['dmtp-from-dflash']}",
    ]
    methods = ["mtp1", "mtp2", "mtp3", "mtp4", "dflash", "dmtp", "dmtp-from-dflash"]
    variants = ["dmtp", "dmtp-from-dflash"]
    bench_methods = ["dmtp", "dflash", "dmtp-from-dflash", "mtp1"]
    heads = {}
    tuned_head, tuned_draft = MODELS / "mtp_head_tuned", MODELS / "dmtp_tuned"
    if (tuned_head / "config.json").is_file() and (tuned_draft / "config.json").is_file():
        models += ["--head", f"tuned={tuned_head}", "--extra-draft", f"dmtp-tuned={tuned_draft}@tuned"]
        methods = [*methods[:4], *(f"mtp{k}@tuned" for k in range(1, 5)), *methods[4:], "dmtp-tuned"]
        drafts["dmtp-tuned"] = tuned_draft
        variants.append("dmtp-tuned")
        heads["tuned MTP head"] = tuned_head
        bench_methods.insert(0, "dmtp-tuned")
        # The DFlash2 backbone: DFlash2 alone and DMTP(D2) on the tuned head (the blog's best configuration).
        d2 = {"dflash2": MODELS / "dflash2", "dmtp-d2": MODELS / "dmtp_d2"}
        if all((folder / "config.json").is_file() for folder in d2.values()):
            models += ["--extra-draft", f"dflash2={d2['dflash2']}", "--extra-draft", f"dmtp-d2={d2['dmtp-d2']}@tuned"]
            methods += list(d2)
            drafts.update(d2)
            bench_methods[1:1] = ["dmtp-d2", "dflash2"]
    return Bundle(
        title="native MTP vs DFlash vs DMTP on a small Qwen3.5-architecture target",
        models=models,
        methods=methods,
        bench_methods=bench_methods,
        drafts=drafts,
        dmtp_variants=variants,
        heads=heads,
    )


def _dmtp(*args: str) -> list[str]:
    return [sys.executable, "-m", "dmtp_hf.cli", *args]


def named_prompts(out: Path) -> Path:
    """Links to the held-out prompt files named after what they hold (the report names a set by its file name)."""
    named = out / "parts" / "prompts"
    named.mkdir(parents=True, exist_ok=True)
    for name, source in (("held-out-code", "code_question.jsonl"), ("held-out-chat", "chat_question.jsonl")):
        link = named / f"{name}.jsonl"
        link.unlink(missing_ok=True)
        link.symlink_to(BENCH / source)
    return named


def run_eval(args, out: Path) -> dict:
    """Acceptance + speedup over the workloads, split over worker processes, merged. With ``--add-strategies``
    only those strategies run (with their own plain-generate baseline), added as columns to OUTPUT_DIR/eval.json."""
    if args.replace_strategies:
        retire_columns(out, args.replace_strategies)
        args.add_strategies = args.replace_strategies
    if not args.add_strategies:
        return _eval_parts(args, out, args.bundle.methods, out)
    unknown = set(args.add_strategies) - set(args.bundle.methods)
    if unknown:
        raise SystemExit(f"--add-strategies: {', '.join(sorted(unknown))} not in this bundle's {args.bundle.methods}")
    existing = json.loads((out / "eval.json").read_text())
    present = [label for label in args.add_strategies if label in {s["label"] for s in existing["strategies"]}]
    if present:  # refused before the (long) evaluation, not after it
        raise SystemExit(f"--add-strategies: {', '.join(present)} already in {out / 'eval.json'}")
    added = out / "parts" / "added"
    _eval_parts(args, added, args.add_strategies, added)
    merge = _dmtp("eval", "--report-only", str(out / "eval.json"), str(added / "eval.json"), "--output-dir", str(out))
    subprocess.run(merge, check=True)
    return json.loads((out / "eval.json").read_text())


def retire_columns(out: Path, labels: list[str]) -> Path:
    """Keep the report as it was under OUTPUT_DIR/history/<date of its eval>/, then drop the columns ``labels``
    from eval.json (their draft or head was replaced) so they can be evaluated again. The bench folders move to the
    history whole: their rows were measured with the replaced models (``--skip-eval`` measures them again)."""
    evaluation = json.loads((out / "eval.json").read_text())
    missing = [label for label in labels if label not in {s["label"] for s in evaluation["strategies"]}]
    if missing:
        raise SystemExit(f"--replace-strategies: {', '.join(missing)} not in {out / 'eval.json'}")
    history = out / "history" / evaluation["created"][:10]
    if history.exists():
        raise SystemExit(f"{history} exists: the report of that run is kept there already")
    history.mkdir(parents=True)
    for path in out.iterdir():
        if path.is_file():
            shutil.copy2(path, history / path.name)
        elif path.name.startswith("bench"):
            shutil.move(str(path), str(history / path.name))
    drop = set(labels)
    evaluation["strategies"] = [s for s in evaluation["strategies"] if s["label"] not in drop]
    for table in [*evaluation["results"].values(), evaluation.get("overall", {})]:
        for label in drop:
            table.pop(label, None)
    for label in drop:
        evaluation.get("column_baselines", {}).pop(label, None)
    if not evaluation.get("column_baselines"):
        evaluation.pop("column_baselines", None)
    evaluation["replaced_columns"] = {"labels": labels, "history": str(history.relative_to(out))}  # for the note
    (out / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    return history


def _eval_parts(args, out: Path, methods: list[str], merged_dir: Path) -> dict:
    named = named_prompts(out)
    held_out = ["held-out-code", "held-out-chat"]
    split = args.bundle.eval_split or [(args.bundle.datasets, []), ([], held_out)]
    if args.workers == 1:
        split = [(args.bundle.datasets, held_out)]
    workloads = [
        [
            "--datasets",
            ",".join(sets) or "none",
            *(arg for f in files for arg in ("--prompts", str(named / f"{f}.jsonl"))),
        ]
        for sets, files in split
    ]
    common = [
        *args.bundle.models,
        "--strategies",
        ",".join(methods),
        "--limit",
        str(args.limit),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--no-progress",
    ]
    if args.temperature:  # the blog's section 7 protocol: sampled, verified by rejection sampling
        sampled = [m for m in methods if not m.endswith(":auto")]
        common[common.index("--strategies") + 1] = ",".join(sampled)
        common += ["--temperature", str(args.temperature), "--verify-mode", "rejection", "--seed", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // len(workloads))), "OMP_WAIT_POLICY": "PASSIVE"}
    procs, parts = [], []
    for index, workload in enumerate(workloads):
        part = out / "parts" / f"part{index}"
        part.mkdir(parents=True, exist_ok=True)
        log = open(part / "eval.log", "w")  # noqa: SIM115 - closed after the process ends
        command = _dmtp("eval", *common, *workload, "--output-dir", str(part))
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log, part))
        parts.append(part / "eval.json")
    for proc, log, part in procs:
        if proc.wait() != 0:
            raise SystemExit(f"eval worker failed, see {part / 'eval.log'}")
        log.close()
    subprocess.run(_dmtp("eval", "--report-only", *map(str, parts), "--output-dir", str(merged_dir)), check=True)
    merged = json.loads((merged_dir / "eval.json").read_text())
    order = [*args.bundle.datasets, *held_out]  # the report's rows in the bundle's order, however the sets were split
    ordered = sorted(merged["datasets"], key=lambda d: order.index(d["name"]) if d["name"] in order else len(order))
    if ordered != merged["datasets"]:
        merged["datasets"] = ordered
        (merged_dir / "eval.json").write_text(json.dumps(merged, indent=2) + "\n")
        merge = _dmtp("eval", "--report-only", str(merged_dir / "eval.json"), "--output-dir", str(merged_dir))
        subprocess.run(merge, check=True)  # eval.md again, in that order
        merged = json.loads((merged_dir / "eval.json").read_text())
    return merged


def _bench_folder(out: Path, groups: list, index: int) -> Path:
    """Where a bench group writes: the report folder itself for a single group, else ``bench-<n>/``."""
    return out if len(groups) == 1 else out / f"bench-{index + 1}"


def run_bench(args, out: Path) -> dict[str, dict]:
    """Throughput of plain generate and the bundle's methods at each batch size, one ``dmtp bench`` per workload
    group; returns group name -> bench.json."""
    named, groups, results = named_prompts(out), args.bundle.bench_groups, {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    for index, (name, datasets, prompt_files) in enumerate(groups):
        folder = _bench_folder(out, groups, index)
        folder.mkdir(parents=True, exist_ok=True)
        prompts = [arg for f in prompt_files for arg in ("--prompts", str(named / f"{f}.jsonl"))]
        command = _dmtp(
            "bench",
            *args.bundle.models,
            "--strategies",
            ",".join(args.bundle.bench_methods),
            "--datasets",
            ",".join(datasets) or "none",
            *prompts,
            "--limit",
            str(args.bench_limit),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--batch-sizes",
            args.batch_sizes,
            "--no-progress",
            "--output-dir",
            str(folder),
        )
        with open(folder / "bench.log", "w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
        results[name] = json.loads((folder / "bench.json").read_text())
    return results


def saved_bench(args, out: Path) -> dict[str, dict]:
    """The bench results a previous run saved (``--report-only``), group name -> bench.json."""
    groups = args.bundle.bench_groups
    found = {name: _bench_folder(out, groups, i) / "bench.json" for i, (name, *_) in enumerate(groups)}
    return {name: json.loads(path.read_text()) for name, path in found.items() if path.is_file()}


def parameter_counts(spec: Bundle) -> dict[str, int]:
    """Parameters of the target (body and MTP head), of extra heads and of each draft, from safetensors headers."""
    from safetensors import safe_open

    def count(folder: Path, predicate=lambda name: True) -> int:
        total = 0
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if predicate(name):
                        total += _numel(f.get_slice(name).get_shape())
        return total

    counts = {}
    target = next((spec.models[i + 1] for i, a in enumerate(spec.models) if a == "--target"), None)
    if target is not None:
        counts["target (without MTP head)"] = count(target, lambda n: not n.startswith("mtp."))
        counts["native MTP head"] = count(target, lambda n: n.startswith("mtp."))
    for label, folder in spec.heads.items():
        counts[label] = count(folder)
    for label, folder in spec.drafts.items():
        counts[f"{label} draft"] = count(folder)
    return counts


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def training_budget(spec: Bundle) -> dict[str, dict]:
    """What each draft's and head's ``training.json`` says (steps, tokens, CPU time, data)."""
    budget = {}
    for label, folder in {**spec.heads, **spec.drafts}.items():
        path = Path(folder) / "training.json"
        if path.is_file():
            budget[label] = json.loads(path.read_text())
    return budget


def _f(value, digits=2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _sampling(settings: dict) -> str:
    temperature = settings.get("temperature") or 0
    if not temperature:
        return "Greedy (T=0)"
    return f"Sampled at T={temperature:g}, {settings.get('verify_mode') or 'rejection'} verification, seed 0"


def _header(evaluation: dict, counts: dict[str, int], args) -> list[str]:
    settings = evaluation["settings"]
    same = all(evaluation["outputs_identical"].values())
    return [
        f"# {args.bundle.title}",
        "",
        f"Generated by `python scripts/reproduce/compare.py --bundle {args.bundle_name} --limit {args.limit} "
        f"--max-new-tokens {args.max_new_tokens}{_bench_flags(args)}` on "
        f"{evaluation['environment'].get('device', 'cpu')} "
        f"({evaluation['created']}). {_sampling(settings)}, target chat template, thinking disabled, up to "
        f"{settings['max_new_tokens']} new tokens per turn, stop at EOS; MT-Bench answered turn by turn. "
        + (
            "Every method produced exactly plain `generate`'s tokens: "
            f"{'yes' if same else 'NO: ' + str(evaluation['outputs_identical'])}."
            if not settings.get("temperature")
            else "Sampled outputs differ from plain `generate`'s by design (the distribution is the target's)."
        )
        + _added_columns(evaluation),
        "",
        "## Models and budgets",
        "",
        "| Model | Parameters |",
        "| --- | --- |",
        *[f"| {name} | {value / 1e6:.2f}M |" for name, value in counts.items()],
        "",
    ]


def _added_columns(evaluation: dict) -> str:
    """A note for columns evaluated in a later run (``--add-strategies``) and merged in."""
    added = list(evaluation.get("column_baselines") or {})
    if not added:
        return ""
    replaced = evaluation.get("replaced_columns") or {}
    again = [label for label in added if label in replaced.get("labels", [])]
    later = [label for label in added if label not in again]
    note = ""
    if later:
        note += (
            f" Column{'s' if len(later) > 1 else ''} {', '.join(f'`{label}`' for label in later)} ran later on the "
            f"same prompts (`--add-strategies {','.join(later)}`), timed against the plain `generate` of that run."
        )
    if again:
        note += (
            f" Column{'s' if len(again) > 1 else ''} {', '.join(f'`{label}`' for label in again)} ran again on the "
            f"same prompts after their models were retrained (`--replace-strategies {','.join(again)}`), timed "
            f"against the plain `generate` of that run; the report before is kept in [{replaced['history']}/]"
            f"({replaced['history']}/README.md)."
        )
    return note


def _bench_flags(args) -> str:
    """The bench options that differ from the defaults, as the command line that reproduces the report."""
    flags = "" if args.bench_limit == 16 else f" --bench-limit {args.bench_limit}"
    flags += f" --temperature {args.temperature:g}" if getattr(args, "temperature", 0) else ""
    return flags + ("" if args.batch_sizes == "1,2,4,8" else f" --batch-sizes {args.batch_sizes}")


def _budget_table(budget: dict) -> list[str]:
    if not budget:
        return []
    lines = [
        "Every draft and head was trained with the project's trainer on target-regenerated data; the table gives "
        "what each `training.json` records (for a model continued from another: the continuation's steps, samples "
        "and time).",
        "",
        "| Model | Init | Steps | Micro-batch x processes | Train samples | CPU wall time | Held-out loss | "
        "Held-out simulated τ / head accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, info in budget.items():
        last = info.get("last_eval") or {}
        init = Path(info["init_from"]).name if info.get("init_from") else "scratch"
        if info.get("train_mtp_head") == "only" and info.get("mtp_init_from"):  # a head continued from another
            init = f"continued from {Path(info['mtp_init_from']).name}"
        loss = last.get("loss", last.get("mtp_loss"))
        quality = _f(last.get("accept_len"), 2) if "accept_len" in last else _f(last.get("mtp_acc"), 3)
        lines.append(
            f"| {label} | {init} | {info.get('steps')} | {info.get('micro_batch_size')} x "
            f"{info.get('num_processes')} | {info.get('train_samples')} | "
            f"{info.get('train_seconds', 0) / 60:.0f} min | {_f(loss, 3)} | {quality} |"
        )
    return [*lines, ""]


def _summary_table(evaluation: dict, rows: list[tuple]) -> list[str]:
    labels = [s["label"] for s in evaluation["strategies"]]
    lines = [
        "## Summary",
        "",
        "Acceptance length τ per request (per verify) · first-candidate acceptance · wall-clock speedup over plain "
        "`generate` (batch size 1, same run, same turns).",
        "",
        "| Workload | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    for key, display, prompts, turns in [*rows, ("overall", "All", None, None)]:
        entries = evaluation["overall"] if key == "overall" else evaluation["results"][key]
        cells = [
            f"{_f(e['acceptance_length_per_request'])} ({_f(e['acceptance_length_per_verify'])}) · "
            f"{100 * (e['first_candidate_acceptance'] or 0):.1f}% · {_f(e.get('speedup'))}×"
            for e in (entries[label] for label in labels)
        ]
        name = display if prompts is None else f"{display} ({prompts} prompts, {turns} turns)"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _versus_dflash(evaluation: dict, rows: list[tuple], variants: list[str]) -> list[str]:
    tau = "acceptance_length_per_request"
    lines = [
        "",
        "### DMTP vs DFlash",
        "",
        "τ per request and its gain over DFlash; first-candidate acceptance; wall-clock speedup over `generate`.",
        "",
        "| Workload | τ DFlash | "
        + " | ".join(f"τ {v} (gain)" for v in variants)
        + " | first-cand. DFlash | "
        + " | ".join(f"first-cand. {v}" for v in variants)
        + " | speedup DFlash | "
        + " | ".join(f"speedup {v}" for v in variants)
        + " |",
        "| --- " * (4 + 3 * len(variants)) + "|",
    ]
    for key, display, *_ in [*rows, ("overall", "All")]:
        entries = evaluation["overall"] if key == "overall" else evaluation["results"][key]
        d = entries["dflash"]
        gains = [f"{_f(entries[v][tau])} ({100 * (entries[v][tau] / d[tau] - 1):+.1f}%)" for v in variants]
        firsts = [f"{100 * entries[v]['first_candidate_acceptance']:.1f}%" for v in variants]
        speeds = [f"{_f(entries[v].get('speedup'))}×" for v in variants]
        lines.append(
            f"| {display} | {_f(d[tau])} | "
            + " | ".join(gains)
            + f" | {100 * d['first_candidate_acceptance']:.1f}% | "
            + " | ".join(firsts)
            + f" | {_f(d.get('speedup'))}× | "
            + " | ".join(speeds)
            + " |"
        )
    return lines


BLOG_COLUMNS = [
    ("MTP-4", "mtp4@tuned"),
    ("DFlash", "dflash"),
    ("DMTP(D)", "dmtp-tuned"),
    ("DFlash2", "dflash2"),
    ("DMTP(D2)", "dmtp-d2"),
]


def _blog_table(evaluation: dict, rows: list[tuple], columns: list[tuple[str, str]]) -> list[str]:
    """The DMTP blog's §8 layout: the five columns, the two DMTP gains, first-candidate acceptance, speedups."""
    tau = "acceptance_length_per_request"
    lines = [
        "",
        "### The blog's open-weight table (§8 layout)",
        "",
        "τ per request; gains of DMTP(D) over DFlash and of DMTP(D2) over DFlash2; first-candidate acceptance and "
        "wall-clock speedup over plain `generate` per column (MTP-4 and both DMTP drafts on the same MTP head: "
        f"{', '.join(f'{n} = {label}' for n, label in columns)}).",
        "",
        "| Workload | "
        + " | ".join(f"τ {name}" for name, _ in columns)
        + " | DMTP(D) vs DFlash | DMTP(D2) vs DFlash2 | first-cand. "
        + " / ".join(n for n, _ in columns)
        + " | speedup "
        + " / ".join(n for n, _ in columns)
        + " |",
        "| --- " * (len(columns) + 5) + "|",
    ]
    for key, display, *_ in [*rows, ("overall", "All")]:
        entries = evaluation["overall"] if key == "overall" else evaluation["results"][key]
        e = {name: entries[label] for name, label in columns}
        gain = [100 * (e[a][tau] / e[b][tau] - 1) for a, b in (("DMTP(D)", "DFlash"), ("DMTP(D2)", "DFlash2"))]
        firsts = " / ".join(f"{100 * e[n]['first_candidate_acceptance']:.1f}%" for n, _ in columns)
        speeds = " / ".join(f"{_f(e[n].get('speedup'))}×" for n, _ in columns)
        lines.append(
            f"| {display} | "
            + " | ".join(_f(e[n][tau]) for n, _ in columns)
            + f" | {gain[0]:+.1f}% | {gain[1]:+.1f}% | {firsts} | {speeds} |"
        )
    return lines


def _bench_table(name: str, bench: dict, folder: str) -> list[str]:
    sizes = bench["settings"]["batch_sizes"]
    lines = [
        f"## Throughput vs batch size (`dmtp bench`): {name}",
        "",
        f"First turns, {bench['settings'].get('num_prompts', '')} prompts, output tokens / wall time of the "
        "workload (prefill included), ratio to plain `generate` at the same batch size.",
        "",
        "| Method | " + " | ".join(f"B={b}" for b in sizes) + " |",
        "| --- | " + " | ".join("---" for _ in sizes) + " |",
    ]
    for method in bench["baselines"]:
        cells = []
        for b in sizes:
            m = method["results"].get(str(b))
            cells.append("—" if not m else f"{m['tokens_per_second']:.1f} tok/s ({m['speedup']:.2f}×)")
        note = f" ({method['skipped']})" if method.get("skipped") else ""
        lines.append(f"| {method['name']}{note} | " + " | ".join(cells) + " |")
    return [*lines, "", f"![throughput]({folder}throughput.png)", ""]


def summary_markdown(
    evaluation: dict, bench: dict[str, dict] | None, counts: dict[str, int], budget: dict, args
) -> str:
    """The report page: models and budgets, one table per workload, DMTP vs DFlash, findings, plots, throughput."""
    rows = [(d["name"], d["display_name"], d["num_prompts"], d["num_turns"]) for d in evaluation["datasets"]]
    lines = _header(evaluation, counts, args) + _budget_table(budget) + _summary_table(evaluation, rows)
    lines += _versus_dflash(evaluation, rows, args.bundle.dmtp_variants)
    labels = {s["label"] for s in evaluation["strategies"]}
    if {label for _, label in args.bundle.blog_columns} <= labels:
        lines += _blog_table(evaluation, rows, args.bundle.blog_columns)
    if args.analysis.is_file():
        lines += ["", "## Findings", "", args.analysis.read_text().strip()]
    lines += [
        "",
        "![acceptance length](acceptance_length.png)",
        "",
        "![cumulative position-wise acceptance](position_acceptance.png)",
        "",
        "![acceptance histogram](acceptance_histogram.png)",
        "",
    ]
    groups = [name for name, *_ in args.bundle.bench_groups]
    folders = {name: "" if len(groups) == 1 else f"bench-{i + 1}/" for i, name in enumerate(groups)}
    for name, result in (bench or {}).items():
        lines += _bench_table(name, result, folders[name])
    lines += [
        "Full tables (per-verify τ, conditional acceptance, per-dataset counts): [eval.md](eval.md); raw data: "
        "[eval.json](eval.json)"
        + "".join(f", [{f}bench.json]({f}bench.json)" for f in map(folders.get, bench or {}))
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run eval (and bench) on the bundled models and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", dest="bundle_name", default="bundled", choices=["bundled", "smollm2"])
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--bench-limit", type=int, default=16, help="prompts per set for dmtp bench")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="dmtp bench batch sizes")
    parser.add_argument("--workers", type=int, default=2, choices=[1, 2])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in total")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (rejection verification, seed 0; no auto widths)",
    )
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-eval", action="store_true", help="reuse OUTPUT_DIR/eval.json, run the bench only")
    parser.add_argument("--report-only", action="store_true", help="rebuild README.md from the saved JSON")
    parser.add_argument(
        "--add-strategies",
        type=lambda text: text.split(","),
        default=[],
        metavar="LABELS",
        help="evaluate only these of the bundle's strategies (comma-separated; e.g. a draft bundled after the "
        "comparison ran) and add them as columns to OUTPUT_DIR/eval.json; each keeps its own generate baseline",
    )
    parser.add_argument(
        "--replace-strategies",
        type=lambda text: text.split(","),
        default=[],
        metavar="LABELS",
        help="evaluate these columns again (their draft or head was retrained and bundled): the report as it was is "
        "kept under OUTPUT_DIR/history/<date>/, the columns are dropped from eval.json and added anew",
    )
    parser.add_argument("--output-dir", type=Path, help="default: reports/<bundle>")
    parser.add_argument(
        "--analysis",
        type=Path,
        help="markdown written by a person after reading the numbers (default: "
        "OUTPUT_DIR/analysis.md when present), included as the report's Findings",
    )
    args = parser.parse_args(argv)
    args.bundle = bundle(args.bundle_name)
    args.output_dir = args.output_dir or REPO / "reports" / args.bundle_name
    args.analysis = args.analysis or args.output_dir / "analysis.md"
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.report_only:
        evaluation = json.loads((out / "eval.json").read_text())
        bench = saved_bench(args, out)
    else:
        for needed in ("code_question.jsonl", "chat_question.jsonl"):
            if not (BENCH / needed).is_file():
                raise SystemExit(f"{BENCH / needed} is missing: run scripts/reproduce/build_corpus.py first")
        evaluation = json.loads((out / "eval.json").read_text()) if args.skip_eval else run_eval(args, out)
        print(f"eval done in {(time.time() - started) / 60:.1f} min", flush=True)
        bench = None if args.skip_bench else run_bench(args, out)
        print(f"eval + bench done in {(time.time() - started) / 60:.1f} min", flush=True)
    report = summary_markdown(evaluation, bench, parameter_counts(args.bundle), training_budget(args.bundle), args)
    (out / "README.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
