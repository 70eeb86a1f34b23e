"""Measuring on a shared CPU: free cores for the thread count, a bounded burner for loaded-machine tables."""

from __future__ import annotations

import json
import os
import time

import pytest

from dmtp_hf.cli import main
from dmtp_hf.machine import Burner, free_cores


def test_free_cores_leaves_the_busy_ones_to_their_owners():
    cores = len(os.sched_getaffinity(0))
    assert free_cores(load=0.0) == cores
    assert free_cores(load=cores + 5.0) == 1  # never fewer than one
    assert free_cores(load=1.0) == max(1, cores - 1)


def test_busy_cores_are_measured_now_so_a_burner_counts():
    from dmtp_hf.machine import _busy_cores

    with Burner(1):  # returns once its process spins: a measurement right after it must count it
        assert _busy_cores(0.5) >= 0.7  # other work on the machine only adds


def test_the_burner_keeps_its_cores_busy_only_inside_its_block():
    with Burner(1) as burner:
        (process,) = burner.processes
        time.sleep(0.5)
        assert process.is_alive()
    assert not process.is_alive()
    with Burner(1, max_seconds=0.2) as burner:  # bounded in time even if its block never ends
        burner.processes[0].join(timeout=30)
        assert not burner.processes[0].is_alive()
    with pytest.raises(ValueError, match="cores >= 0"):
        Burner(-1)


def test_bench_under_a_burner_reports_threads_load_and_the_spread_of_repeats(models_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--target", str(models_dir / "target"), "--dflash-draft", str(models_dir / "dflash")]
    argv += ["--strategies", "dflash", "--datasets", "gsm8k", "--limit", "2", "--max-new-tokens", "6"]
    argv += ["--repeats", "2", "--burner", "1", "--threads", "1", "--output-dir", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["settings"]["burner_cores"] == 1 and data["settings"]["threads"] == 1
    for baseline in data["baselines"]:
        entry = baseline["results"]["1"]
        if baseline["skipped"] is None:
            assert len(entry["tokens_per_second_runs"]) == 2 and entry["spread"] >= 0
            runs = entry["tokens_per_second_runs"]
            assert min(runs) <= entry["median_tokens_per_second"] <= max(runs)
    names = [b["name"] for b in data["baselines"] if b["skipped"] is None]
    assert "hf_dflash" in names  # Transformers' own DFlash path on the same weights, timed side by side
    printed = " ".join(capsys.readouterr().out.split())  # the table's title wraps
    assert "± spread of 2 repeats" in printed and "a CPU burner on 1 core" in printed


def test_a_burner_stops_when_its_parent_is_killed():
    """A run killed by a signal cannot stop its burners; they stop themselves."""
    import subprocess
    import sys

    code = (
        "from dmtp_hf.machine import Burner\nimport time\n"
        "with Burner(1) as b:\n    print(b.processes[0].pid, flush=True)\n    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    burner = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            os.kill(burner, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(burner, 9)
    raise AssertionError("the burner outlived its killed parent by 10 s")


def test_a_periodic_burner_switches_its_load_on_and_off():
    """``period=S``: a load that changes during a measurement (on S seconds, off S seconds)."""
    with Burner(1, period=0.4) as burner:
        states = []
        for _ in range(10):
            states.append(burner.active.is_set())
            time.sleep(0.2)
        assert True in states and False in states
    with pytest.raises(ValueError, match="period must be > 0"):
        Burner(1, period=0)
