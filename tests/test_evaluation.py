"""Evaluation and benchmarking (issue 8): `dmtp eval` over the bundled prompt sets with metrics recomputable from
the saved raw histograms, `dmtp bench` with every baseline side by side, model cards from eval JSON, push to a
stand-in Hub repo and load back offline, one-line errors for malformed prompt files."""

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dmtp_hf import DMTPConfig
from dmtp_hf.assistant.drafters.base import Drafter, Proposal
from dmtp_hf.cli import main
from dmtp_hf.evaluation import (
    BUNDLED_SETS,
    PromptFileError,
    build_baselines,
    bundled_data_dir,
    card_template_text,
    load_bundled_set,
    load_prompt_file,
    render_model_card,
)
from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target

REPO_ROOT = Path(__file__).resolve().parents[1]


class TargetOracle(Drafter):
    """Wraps a real drafter and overwrites a random-length prefix of its candidates with the target's own greedy
    continuation. The tiny drafts are untrained (they would be rejected every round, so every histogram would be
    ``[rounds, 0, ..]``); this makes rounds accept every possible number of candidates, so the saved histograms and
    per-request counts are non-trivial and the recomputation below means something. Decoding stays lossless."""

    def __init__(self, inner: Drafter, target, seed: int):
        self.inner, self.target, self.rng = inner, target, random.Random(seed)
        self.num_candidates, self.name = inner.num_candidates, inner.name
        self.needs_features, self.needs_mtp_hidden = inner.needs_features, inner.needs_mtp_hidden
        self.hidden_input = getattr(inner, "hidden_input", "post_norm")

    def target_layer_ids(self):
        return self.inner.target_layer_ids()

    # *args/**kwargs: forward whatever the engine passes (its Drafter signature is still evolving)
    def start(self, *args, **kwargs):
        self.inner.start(*args, **kwargs)

    def advance(self, *args, **kwargs):
        self.inner.advance(*args, **kwargs)

    def propose(self, anchor_ids, anchor_positions, select, stats, *args, **kwargs):
        proposal = self.inner.propose(anchor_ids, anchor_positions, select, stats, *args, **kwargs)
        sequence = select.committed_ids()[0]
        count = self.rng.randint(0, self.num_candidates)
        if not count:
            return proposal
        truth = self.target.generate(sequence, do_sample=False, max_new_tokens=count, pad_token_id=0)
        truth = truth[:, sequence.shape[1] :]
        tokens = proposal.tokens.clone()
        tokens[:, : truth.shape[1]] = truth
        return Proposal(tokens, proposal.scores)


@pytest.fixture(scope="module")
def eval_run(models_dir, tmp_path_factory):
    """One `dmtp eval` over all five bundled sets plus a user prompt file (drafters wrapped in `TargetOracle`);
    returns (output dir, stdout)."""
    import dmtp_hf.evaluation.models as eval_models

    build = eval_models.build_strategies

    def build_with_oracle(labels, target, paths, **kwargs):
        strategies = build(labels, target, paths, **kwargs)
        for seed, strategy in enumerate(strategies):
            strategy.drafter = TargetOracle(strategy.drafter, target, seed)
        return strategies

    out = tmp_path_factory.mktemp("eval_out")
    user = out / "my_prompts.jsonl"
    user.write_text(json.dumps({"question_id": "a", "turns": ["write a python function", "how many are there ?"]}))
    argv = [
        "eval",
        "--target",
        str(models_dir / "target"),
        "--draft",
        str(models_dir / "dmtp"),
        "--dflash-draft",
        str(models_dir / "dflash"),
        "--strategies",
        "dmtp,dflash,mtp2",
        "--prompts",
        str(user),
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--output-dir",
        str(out / "results"),
        "--no-progress",
    ]
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer), pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_models, "build_strategies", build_with_oracle)
        assert main(argv) == 0
    return out / "results", buffer.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# Prompt sets


def test_bundled_prompt_sets_ship_with_attribution():
    data = bundled_data_dir()
    assert (data / "SOURCES.md").is_file()
    assert "SafeAILab/EAGLE" in (data / "SOURCES.md").read_text()
    full = {"gsm8k": 80, "humaneval": 80, "math500": 500, "alpaca": 80, "mt_bench": 80}
    assert set(BUNDLED_SETS) == set(full)
    for name, rows in full.items():
        assert len(load_bundled_set(name, limit=None).prompts) == rows
        assert len(load_bundled_set(name).prompts) == min(rows, 80)  # blog protocol: first 80
    mt_bench = load_bundled_set("mt_bench", limit=3)
    assert [len(p.turns) for p in mt_bench.prompts] == [2, 2, 2]
    assert mt_bench.prompts[0].question_id == 81


@pytest.mark.parametrize(
    "bad_line,reason",
    [
        ('{"turns": ["ok"', "invalid JSON"),
        ('{"question_id": 3, "category": "x"}', 'missing "turns"'),
        ('{"turns": ["fine", 7]}', '"turns"[1] must be a non-empty string'),
        ('["not", "an", "object"]', "expected a JSON object"),
    ],
)
def test_malformed_prompt_file_is_one_line_error(tmp_path, capsys, bad_line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": ["one"]}\n\n' + bad_line + "\n")  # blank line 2 is fine; line 3 is not
    with pytest.raises(PromptFileError) as info:
        load_prompt_file(path)
    assert (info.value.line, str(info.value.path)) == (3, str(path))
    # Through the CLI: prompts are validated before any model is loaded (the target path does not even exist).
    for command in ("eval", "bench"):
        code = main([command, "--target", str(tmp_path / "nowhere"), "--datasets", "none", "--prompts", str(path)])
        err = capsys.readouterr().err
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert f"{path}:3:" in lines[0] and reason in lines[0], lines[0]
        assert "Traceback" not in err


def test_missing_models_without_bundled_defaults_is_a_clear_error(capsys, monkeypatch, tmp_path):
    import dmtp_hf.bundled as bundled

    monkeypatch.setattr(bundled, "MODELS_DIR", tmp_path)  # as on an install without the bundled checkpoints
    assert main(["eval", "--datasets", "gsm8k", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--target" in err and "--draft" in err


def test_omitted_paths_resolve_to_the_bundled_models():
    from dmtp_hf.bundled import default_paths
    from dmtp_hf.evaluation.models import resolve_model_paths

    bundled = default_paths()
    paths = resolve_model_paths(None, None)
    # The default DMTP is the best configuration: the tuned MTP head and the draft adapted to it.
    assert paths.target == str(bundled["target"]) and paths.draft == str(bundled["dmtp_tuned"])
    assert paths.mtp_head == str(bundled["mtp_head_tuned"]) and paths.dflash_draft == str(bundled["dflash"])
    # The drafts trained on the target's own head keep it.
    assert paths.heads == {"native": str(bundled["target"])}
    expected = {
        "dmtp-native-head": f"{bundled['dmtp']}@native",
        "dmtp-from-dflash": f"{bundled['dmtp_from_dflash']}@native",
    }
    # The DFlash2 backbone's drafts, when bundled: DMTP(D2) on the default (tuned) head
    from dmtp_hf.bundled import MODELS_DIR, OPTIONAL_MODELS

    for name, folder in OPTIONAL_MODELS.items():
        if (MODELS_DIR / folder / "config.json").is_file():
            expected[name.replace("_", "-")] = str(MODELS_DIR / folder)
    assert paths.extra_drafts == expected


def test_default_strategies_bind_the_tuned_head_and_the_native_one_where_trained():

    from dmtp_hf.assistant.target.loading import load_target
    from dmtp_hf.evaluation.models import build_strategies, resolve_model_paths

    paths = resolve_model_paths(None, None)
    target = load_target(paths.target, dtype=torch.float32)
    strategies = {
        s.label: s for s in build_strategies(["dmtp", "dmtp-native-head", "dmtp-from-dflash", "mtp1"], target, paths)
    }
    tuned, native = strategies["dmtp"].drafter.head, strategies["dmtp-native-head"].drafter.head
    assert strategies["mtp1"].drafter.head is tuned and strategies["dmtp-from-dflash"].drafter.head is native
    # Two different heads: the tuned one moved away from the target's own `mtp.*` weights.
    tuned_params, native_params = dict(tuned.named_parameters()), dict(native.named_parameters())
    assert tuned_params.keys() == native_params.keys()
    assert any(not torch.equal(tuned_params[n], native_params[n]) for n in tuned_params)


# ---------------------------------------------------------------------------------------------------------------
# dmtp eval


def test_eval_all_bundled_sets_metrics_recomputable(eval_run):
    out, stdout = eval_run
    for name in (
        "eval.json",
        "eval.md",
        "acceptance_length.png",
        "position_acceptance.png",
        "acceptance_histogram.png",
    ):
        assert (out / name).stat().st_size > 0, name
    for name in ("acceptance_length.png", "position_acceptance.png", "acceptance_histogram.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "eval.json").read_text())
    assert [d["name"] for d in data["datasets"]] == [*BUNDLED_SETS, "my_prompts"]
    assert data["settings"]["max_new_tokens"] == 8 and data["settings"]["limit"] == 2
    assert data["settings"]["chat_template"] and not data["settings"]["enable_thinking"]
    labels = ["dmtp", "dflash", "mtp2"]
    assert [s["label"] for s in data["strategies"]] == labels
    assert [s["num_candidates"] for s in data["strategies"]] == [7, 7, 2]

    turns = {d["name"]: d["num_turns"] for d in data["datasets"]}
    assert turns == {"gsm8k": 2, "humaneval": 2, "math500": 2, "alpaca": 2, "mt_bench": 4, "my_prompts": 2}
    total_rounds = 0
    for dataset, by_strategy in data["results"].items():
        assert list(by_strategy) == labels
        for entry in by_strategy.values():
            hist, requests, meta = entry["hist"], entry["requests"], entry["request_meta"]
            assert len(requests) == len(meta) == turns[dataset]  # one request per turn
            # the aggregate histogram is the sum of the per-request histograms
            assert [sum(column) for column in zip(*[r["hist"] for r in requests])] == hist
            assert all(sum(r["hist"]) == r["rounds"] for r in requests)
            # every output token is the prefill token or committed by a verify round
            assert all(r["round_tokens"] + 1 == m["output_tokens"] for r, m in zip(requests, meta))
            assert all(1 <= m["output_tokens"] <= 8 for m in meta)
            rounds = sum(hist)
            assert rounds == entry["num_rounds"]
            total_rounds += rounds
            if not rounds:
                continue
            per_verify = 1 + sum(k * count for k, count in enumerate(hist)) / rounds
            assert entry["acceptance_length_per_verify"] == pytest.approx(per_verify, rel=1e-12)
            per_request = [r["round_tokens"] / r["rounds"] for r in requests if r["rounds"]]
            assert entry["acceptance_length_per_request"] == pytest.approx(sum(per_request) / len(per_request))
            assert entry["first_candidate_acceptance"] == pytest.approx(1 - hist[0] / rounds)
            cumulative = [sum(hist[k:]) / rounds for k in range(1, len(hist))]
            assert entry["cumulative_acceptance"] == pytest.approx(cumulative)
            conditional = [
                sum(hist[k:]) / sum(hist[k - 1 :]) if sum(hist[k - 1 :]) else None for k in range(1, len(hist))
            ]
            assert entry["conditional_acceptance"] == pytest.approx(conditional, nan_ok=True)
        # MT-Bench: two turns per prompt, the second conditioned on the first turn and the model's own answer
        if dataset == "mt_bench":
            meta = by_strategy["dmtp"]["request_meta"]
            assert [m["turn"] for m in meta] == [0, 1, 0, 1]
            for first, second in zip(meta[::2], meta[1::2]):
                assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"] - 1
    assert total_rounds > 0
    for label in labels:  # the oracle makes the histograms non-trivial (see TargetOracle)
        assert sum(1 for count in data["overall"][label]["hist"] if count) >= min(
            3, len(data["overall"][label]["hist"])
        )
    # T=0: every strategy is lossless, so all produce the same tokens
    assert all(data["outputs_identical"].values()), data["outputs_identical"]
    # the all-datasets row merges every dataset's histogram
    for label in labels:
        merged = [sum(column) for column in zip(*[data["results"][d][label]["hist"] for d in data["results"]])]
        assert data["overall"][label]["hist"] == merged

    markdown = (out / "eval.md").read_text()
    for display in ["GSM8K", "HumanEval", "MATH500", "Alpaca", "MT-Bench", "my_prompts", "dmtp vs. dflash"]:
        assert display in markdown
    for by_strategy in data["results"].values():
        for entry in by_strategy.values():
            if entry["num_rounds"]:
                assert f"{entry['acceptance_length_per_request']:.3f}" in markdown
                assert f"{entry['acceptance_length_per_verify']:.3f}" in markdown
    assert "acceptance length per request" in stdout and "eval.json" in stdout


def test_eval_speedup_is_measured_against_plain_generate_in_the_same_run(eval_run):
    out, _ = eval_run
    data = json.loads((out / "eval.json").read_text())
    baseline = data["baseline"]
    assert set(baseline) == {*data["results"], "overall"}
    for dataset, by_strategy in data["results"].items():
        base = baseline[dataset]
        # plain generate produced exactly the speculative strategies' tokens (digest included in outputs_identical)
        assert base["output_digest"] == by_strategy["dmtp"]["output_digest"]
        assert base["output_tokens"] == by_strategy["dmtp"]["output_tokens"] > 0
        for entry in by_strategy.values():
            ratio = (entry["output_tokens"] / entry["wall_seconds"]) / (base["output_tokens"] / base["wall_seconds"])
            assert entry["speedup"] == pytest.approx(ratio)
    markdown = (out / "eval.md").read_text()
    assert "Wall-clock speedup over plain `target.generate`" in markdown
    assert f"{data['overall']['dmtp']['speedup']:.2f}×" in markdown


def test_eval_report_only_merges_split_runs(eval_run, tmp_path, capsys):
    out, _ = eval_run
    data = json.loads((out / "eval.json").read_text())
    names = [d["name"] for d in data["datasets"]]
    parts = []
    for chunk in (names[:2], names[2:]):  # as if two processes had each run some of the sets
        part = {**data, "datasets": [d for d in data["datasets"] if d["name"] in chunk]}
        part["results"] = {n: data["results"][n] for n in chunk}
        part["baseline"] = {n: data["baseline"][n] for n in chunk}
        part["outputs_identical"] = {n: data["outputs_identical"][n] for n in chunk}
        part["overall"] = "stale"  # recomputed from the per-dataset entries
        # each process times the target for `auto` itself: a measurement, not a setting (part 1 as older files
        # wrote it, under settings)
        if parts:
            part["settings"] = {**data["settings"], "auto_cost_measure_seconds": 2.5}
            del part["auto_cost_measure_seconds"]
        else:
            part["auto_cost_measure_seconds"] = 1.25
        path = tmp_path / f"part{len(parts)}.json"
        path.write_text(json.dumps(part))
        parts.append(path)
    merged_dir = tmp_path / "merged"
    assert main(["eval", "--report-only", *map(str, parts), "--output-dir", str(merged_dir)]) == 0
    merged = json.loads((merged_dir / "eval.json").read_text())
    assert merged["results"] == data["results"] and merged["baseline"] == data["baseline"]
    for label, entry in data["overall"].items():
        for key in ("hist", "acceptance_length_per_verify", "acceptance_length_per_request", "speedup"):
            assert merged["overall"][label][key] == pytest.approx(entry[key]), (label, key)
    assert (merged_dir / "eval.md").read_text() == (out / "eval.md").read_text()
    assert merged["auto_cost_measure_seconds"] == pytest.approx(3.75)
    assert "auto_cost_measure_seconds" not in merged["settings"] and merged["settings"] == data["settings"]
    # overlapping or mismatched parts are refused with a one-line error
    assert main(["eval", "--report-only", str(parts[0]), str(parts[0]), "--output-dir", str(merged_dir)]) == 2
    assert "appears in more than one file" in capsys.readouterr().err
    other = json.loads(parts[1].read_text())
    other["settings"]["max_new_tokens"] += 1
    parts[1].write_text(json.dumps(other))
    assert main(["eval", "--report-only", *map(str, parts), "--output-dir", str(merged_dir)]) == 2
    assert "different settings" in capsys.readouterr().err


def test_eval_report_only_adds_columns_from_another_run(eval_run, tmp_path, capsys):
    """A strategy evaluated later on the same prompts joins as a column; its speedup stays against the plain
    generate timed in its own run."""
    out, _ = eval_run
    data = json.loads((out / "eval.json").read_text())
    labels = [s["label"] for s in data["strategies"]]
    parts, slow = [], 2.0  # the second run's machine was twice as slow, baseline and strategies alike
    for chunk, scale in ((labels[:1], 1.0), (labels[1:], slow)):
        part = json.loads(json.dumps(data))
        part["strategies"] = [s for s in data["strategies"] if s["label"] in chunk]
        for name in part["results"]:
            part["results"][name] = {k: v for k, v in part["results"][name].items() if k in chunk}
            for entry in [*part["results"][name].values(), part["baseline"][name]]:
                entry["wall_seconds"] *= scale
        path = tmp_path / f"columns{len(parts)}.json"
        path.write_text(json.dumps(part))
        parts.append(path)
    merged_dir = tmp_path / "merged"
    assert main(["eval", "--report-only", *map(str, parts), "--output-dir", str(merged_dir)]) == 0
    merged = json.loads((merged_dir / "eval.json").read_text())
    assert [s["label"] for s in merged["strategies"]] == labels
    assert merged["baseline"] == data["baseline"] and set(merged["column_baselines"]) == set(labels[1:])
    for name in [*data["results"], "overall"]:
        by_label = merged["results"].get(name) or merged["overall"]
        reference = data["results"].get(name) or data["overall"]
        for label in labels:
            assert by_label[label]["hist"] == reference[label]["hist"]
            assert by_label[label]["speedup"] == pytest.approx(reference[label]["speedup"]), (name, label)
    assert "ran in a separate run" in (merged_dir / "eval.md").read_text()
    # the later run may have run the sets in another order (its workers split them otherwise): still columns
    other = json.loads(parts[1].read_text())
    other["datasets"].reverse()
    parts[1].write_text(json.dumps(other))
    assert main(["eval", "--report-only", *map(str, parts), "--output-dir", str(tmp_path / "reordered")]) == 0
    reordered = json.loads((tmp_path / "reordered" / "eval.json").read_text())
    assert reordered["datasets"] == data["datasets"] and reordered["results"] == merged["results"]
    # at T = 0 the two runs' plain generate must agree token for token
    other = json.loads(parts[1].read_text())
    other["baseline"][data["datasets"][0]["name"]]["output_digest"] = "0" * 64
    parts[1].write_text(json.dumps(other))
    assert main(["eval", "--report-only", *map(str, parts), "--output-dir", str(merged_dir)]) == 2
    assert "plain generate produced different tokens" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# dmtp bench


def test_bench_prints_every_baseline_side_by_side(models_dir, tmp_path):
    import io
    from contextlib import redirect_stdout

    out = tmp_path / "bench"
    argv = [
        "bench",
        "--target",
        str(models_dir / "target"),
        "--draft",
        str(models_dir / "dmtp"),
        "--dflash-draft",
        str(models_dir / "dflash"),
        "--assistant",
        str(models_dir / "assistant"),
        "--strategies",
        "dmtp,dmtp:auto,dflash,mtp2",
        "--datasets",
        "gsm8k,mt_bench",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--batch-sizes",
        "1,2",
        "--prompt-lookup-tokens",
        "3",
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(argv) == 0
    printed = buffer.getvalue()
    rows = ["generate", "dmtp", "dmtp:auto", "dflash", "mtp2", "prompt_lookup", "hf_use_mtp", "hf_dflash", "assisted"]
    table_lines = [line for line in printed.splitlines() if "│" in line]
    for name in rows:
        assert any(line.split("│")[1].strip() == name for line in table_lines), (name, printed)
    assert "skipped" not in printed

    data = json.loads((out / "bench.json").read_text())
    assert [b["name"] for b in data["baselines"]] == rows
    assert data["settings"]["num_prompts"] == 4 and data["complete"] is True
    for baseline in data["baselines"]:
        assert baseline["skipped"] is None, baseline
        one = baseline["results"]["1"]
        assert one["output_tokens"] > 0 and one["seconds"] > 0 and one["tokens_per_second"] > 0
        assert one["speedup"] == pytest.approx(
            one["tokens_per_second"] / data["baselines"][0]["results"]["1"]["tokens_per_second"]
        )
        assert one["matches_generate"] == 1.0, baseline["name"]  # greedy: every method is lossless
        # batch size 2: plain generate and our batched engine run; Transformers' assisted built-ins are batch-1 only
        batched = (
            baseline["name"] == "generate"
            or baseline["name"] in ("dmtp", "dmtp:auto", "dflash")
            or baseline["name"].startswith("mtp")
        )
        assert (baseline["results"]["2"] is not None) == batched, baseline["name"]
    assert data["baselines"][0]["results"]["1"]["speedup"] == pytest.approx(1.0)
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    # the cost curve auto weighs, per batch size and width (1 .. K + 1), printed and saved
    assert sorted(data["verify_costs"]) == ["1", "2"] and list(data["verify_costs"]["1"]) == [
        str(w) for w in range(1, 9)
    ]
    assert all(t > 0 for by_width in data["verify_costs"].values() for t in by_width.values())
    assert "target forward cost per width" in printed


def test_an_interrupted_bench_keeps_the_batch_sizes_it_measured(models_dir, tmp_path, monkeypatch):
    from dmtp_hf.evaluation import throughput

    timed = throughput._time_batch_size

    def interrupted(bs, *args, **kwargs):
        if bs == 2:
            raise KeyboardInterrupt  # the run stops while timing its second batch size
        return timed(bs, *args, **kwargs)

    monkeypatch.setattr(throughput, "_time_batch_size", interrupted)
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--target",
        str(models_dir / "target"),
        "--draft",
        str(models_dir / "dmtp"),
        "--strategies",
        "dmtp",
        "--datasets",
        "gsm8k",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--batch-sizes",
        "1,2",
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    data = json.loads((out / "bench.json").read_text())
    assert data["complete"] is False and [b["name"] for b in data["baselines"]][:2] == ["generate", "dmtp"]
    for baseline in data["baselines"]:
        measured = baseline["results"]["1"] is not None
        assert measured == (baseline["skipped"] is None) and baseline["results"]["2"] is None, baseline
    assert all(b["results"]["1"]["tokens_per_second"] > 0 for b in data["baselines"][:2])
    assert data["models"]["target"] and not list(out.glob(".*"))  # no temporary file left behind


def test_bench_notes_builtins_a_stateful_target_cannot_run(tmp_path):
    target = load_tiny_target(make_tiny_target("qwen3_5", tmp_path / "qwen3_5"))
    baselines = {b.name: b for b in build_baselines(target, [], {"max_new_tokens": 4}, assistant=target)}
    assert baselines["generate"].skipped is None
    for name in ("prompt_lookup", "hf_use_mtp", "hf_dflash", "assisted"):
        assert "stateful" in baselines[name].skipped


# ---------------------------------------------------------------------------------------------------------------
# Model card and Hub


def test_card_template_is_packaged_and_mirrored():
    assert (REPO_ROOT / "model_cards" / "dmtp_card.md").read_text() == card_template_text()


def test_model_card_renders_the_eval_json_numbers(eval_run, models_dir):
    out, _ = eval_run
    data = json.loads((out / "eval.json").read_text())
    config = DMTPConfig.from_pretrained(models_dir / "dmtp")
    card = render_model_card(config, "org/tiny-dmtp", results=data, training_data="OpenPerfectBlend, regenerated")
    assert card.startswith("---\n") and "$" not in card.split("## Citation")[0].replace("$$", "")
    assert str(models_dir / "target") in card
    assert "`dual`" in card and "`residual`" in card and "OpenPerfectBlend, regenerated" in card
    assert 'DMTPDraftModel.from_pretrained("org/tiny-dmtp", target=target)' in card
    assert "assistant_model=dmtp" in card
    for dataset in data["datasets"]:
        section = card.split("## Acceptance")[1]
        row = next(line for line in section.splitlines() if line.startswith(f"| {dataset['display_name']} |"))
        entries = data["results"][dataset["name"]]
        for label in ("dmtp", "dflash", "mtp2"):
            value = entries[label]["acceptance_length_per_request"]
            assert (f"{value:.3f}" if value is not None else "n/a") in row
        dmtp, dflash = (
            entries["dmtp"]["acceptance_length_per_request"],
            entries["dflash"]["acceptance_length_per_request"],
        )
        if dmtp is not None and dflash:
            assert f"{100 * (dmtp / dflash - 1):+.2f}%" in row
        first = data["results"][dataset["name"]]["dmtp"]["first_candidate_acceptance"]
        if first is not None:
            assert f"{100 * first:.2f}%" in section
        speed = section.split("Wall-clock speedup")[1]
        row = next(line for line in speed.splitlines() if line.startswith(f"| {dataset['display_name']} |"))
        assert f"{entries['dmtp']['speedup']:.2f}×" in row


class _CacheStandInApi:
    """Stands in for `huggingface_hub.HfApi`: 'uploading' lays the folder out as a populated HF cache entry."""

    cache: Path
    calls: list = []

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, repo_type="model", private=False, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private))

    def upload_folder(self, *, repo_id, folder_path, repo_type="model", revision=None, commit_message=""):
        self.calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))
        revision_hash = "0123456789abcdef0123456789abcdef01234567"
        repo = self.cache / f"models--{repo_id.replace('/', '--')}"
        shutil.copytree(folder_path, repo / "snapshots" / revision_hash)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / (revision or "main")).write_text(revision_hash)
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/{revision_hash}"})()


def test_push_to_stand_in_repo_and_load_back_offline(eval_run, models_dir, tmp_path, monkeypatch, capsys):
    import dmtp_hf.evaluation.hub as hub

    out, _ = eval_run
    _CacheStandInApi.cache = tmp_path / "hub-cache"
    _CacheStandInApi.calls = []
    monkeypatch.setattr(hub, "HfApi", _CacheStandInApi)
    argv = ["push", str(models_dir / "dmtp"), "org/tiny-dmtp", "--eval-json", str(out / "eval.json")]
    assert main([*argv, "--training-data", "tiny random data", "--private"]) == 0
    assert "pushed" in capsys.readouterr().out
    assert _CacheStandInApi.calls[0] == ("create_repo", "org/tiny-dmtp", True)
    uploaded = _CacheStandInApi.calls[1][2]
    assert {"README.md", "config.json", "dmtp_eval.json", "model.safetensors", "modeling_dmtp.py"} <= set(uploaded)
    assert "custom_generate" in uploaded  # the repo carries its own code (tests/test_hub.py runs it)

    # Load back through the Hub code path, offline, in a fresh interpreter (HF_HUB_* are read at import time).
    script = textwrap.dedent(
        """
        import sys, torch
        from huggingface_hub import hf_hub_download
        from dmtp_hf import DMTPDraftModel
        from dmtp_hf_assets.tiny_targets import load_tiny_target
        target = load_tiny_target(sys.argv[1])
        pushed = DMTPDraftModel.from_pretrained("org/tiny-dmtp", target=target)
        original = DMTPDraftModel.from_pretrained(sys.argv[2])
        assert pushed.config.anchor_layout == original.config.anchor_layout == "dual"
        theirs = original.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in pushed.state_dict().items())
        assert not pushed.fusion.is_noop()
        print("README", hf_hub_download("org/tiny-dmtp", "README.md"))
        """
    )
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(_CacheStandInApi.cache),
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    run = subprocess.run(
        [sys.executable, "-c", script, str(models_dir / "target"), str(models_dir / "dmtp")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    readme = Path(run.stdout.split("README ")[1].strip()).read_text()
    data = json.loads((out / "eval.json").read_text())
    gsm8k = data["results"]["gsm8k"]["dmtp"]["acceptance_length_per_request"]
    assert f"{gsm8k:.3f}" in readme and "tiny random data" in readme


def test_push_without_upload_writes_the_folder(models_dir, tmp_path, capsys):
    folder = tmp_path / "repo"
    assert main(["push", str(models_dir / "dflash"), "org/tiny-dflash", "--local-dir", str(folder), "--no-upload"]) == 0
    names = {p.name for p in folder.iterdir()}
    assert {"README.md", "config.json", "model.safetensors", "modeling_dmtp.py", "custom_generate"} <= names
    card = (folder / "README.md").read_text()
    assert "`dflash`" in card and "No evaluation results" in card
    assert main(["push", str(models_dir / "dflash"), "not-a-repo-id", "--local-dir", str(folder), "--no-upload"]) == 2
    assert "ORG/NAME" in capsys.readouterr().err
