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


def test_speculative_generate_warns_once_when_threads_outnumber_the_free_cores(monkeypatch):
    """On a loaded machine, threads waiting for cores made the README snippet run at 0.40x plain generate (2
    threads) instead of 1.8x (1 thread): the first speculative generate of a process says how to set them."""
    import warnings

    import torch
    from conftest import draft_for, tiny_qwen3_target

    from dmtp_hf import machine

    target = tiny_qwen3_target()
    draft = draft_for(target, anchor_layout="dflash")
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])

    def speculative_generate():
        target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=4)

    measured = []
    monkeypatch.setattr(machine, "free_cores", lambda window=0.5: measured.append(window) or 1)  # one core free
    monkeypatch.setattr(machine, "_threads_checked", False)  # as in a fresh process
    threads = torch.get_num_threads()
    try:
        with monkeypatch.context() as two_threads, warnings.catch_warnings(record=True) as caught:
            two_threads.setattr(torch, "get_num_threads", lambda: 2)  # what torch reports, without the slow-down
            warnings.simplefilter("always")
            for _ in range(2):
                speculative_generate()
        told = [str(w.message) for w in caught if "intra-op threads" in str(w.message)]
        assert len(told) == 1 and len(measured) == 1  # once per process, one short measurement
        assert "torch.set_num_threads(1)" in told[0] and "dmtp_hf.machine.set_threads()" in told[0]

        monkeypatch.setattr(machine, "_threads_checked", False)
        assert machine.set_threads() == 1 and torch.get_num_threads() == 1  # the free cores, as the demo chooses
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a count chosen for this machine is not warned about
            speculative_generate()
    finally:
        torch.set_num_threads(threads)


def test_eval_sets_its_threads_like_the_demo(models_dir, tmp_path, monkeypatch):
    """``dmtp eval`` ran on torch's default threads (0.43x plain on a loaded machine, 1.58x with one thread):
    ``--threads N`` sets them, and without it the free cores do (OMP_NUM_THREADS, when set, wins)."""
    import torch

    from dmtp_hf import machine

    chosen = []
    monkeypatch.setattr(machine, "free_cores", lambda window=0.5: 1)
    real = machine.set_threads
    monkeypatch.setattr(
        machine, "set_threads", lambda threads=None, reserved=0: chosen.append(threads) or real(threads)
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    argv = ["eval", "--target", str(models_dir / "target"), "--dflash-draft", str(models_dir / "dflash")]
    argv += ["--strategies", "dflash", "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "4", "--no-baseline"]
    argv += ["--output-dir", str(tmp_path / "eval"), "--no-progress"]
    try:
        assert main([*argv, "--threads", "1"]) == 0
        assert main(argv) == 0
        assert chosen == [1, None] and torch.get_num_threads() == 1
        assert main([*argv, "--threads", "0"]) == 2  # refused before anything loads
    finally:
        torch.set_num_threads(threads)
