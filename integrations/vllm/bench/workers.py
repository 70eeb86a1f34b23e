"""Benchmark worker processes, each holding one engine, driven over stdin/stdout (``vllm_worker.py``,
``hf_worker.py``). Standard library only: the orchestrators run in either environment (dmtp-hf's or vLLM's)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# vLLM's environment (its CPU build here; DMTP_VLLM_PYTHON points at another, such as a GPU build's)
VLLM_PYTHON = Path(os.environ.get("DMTP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
HERE = Path(__file__).resolve().parent

# vLLM's n-gram proposer as the benchmarks run it: n-grams of 2 to 4 tokens, like the plugin's prompt lookup
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def vllm_worker(
    target: str,
    dtype: str = "float32",
    eager: bool = True,
    max_num_seqs: int | None = None,
    speculative: dict | None = None,
    policy_report: bool = False,
) -> list[str]:
    """The command of a ``vllm_worker.py`` process: one engine for ``target`` (``speculative``: its speculative
    config; ``policy_report``: answers carry the DMTP policy's counters)."""
    command = [str(VLLM_PYTHON), str(HERE / "vllm_worker.py"), "--target", target, "--dtype", dtype]
    command += ["--eager"] if eager else []
    command += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs is not None else []
    command += ["--speculative-config", json.dumps(speculative)] if speculative is not None else []
    return command + (["--policy-report"] if policy_report else [])


class Worker:
    """A method's worker process; ``run(prompts)`` sends one job and returns its answer."""

    def __init__(self, label: str, command: list[str], env: dict[str, str], cores: set[int]):
        self.label = label
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),  # every thread it starts inherits the cores
        )
        self.read()  # {"ready": true}

    def read(self) -> dict:
        """The worker's next answer line (its other output is vLLM's logging)."""
        for line in self.process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"worker {self.label} exited with code {self.process.wait()}")

    def run(self, prompts: list[dict], **options) -> dict:
        """One job: ``prompts`` submitted together (``options``: the worker's job options)."""
        self.process.stdin.write(json.dumps({"prompts": prompts, **options}) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        """End the worker (its stdin closes) and wait for it."""
        self.process.stdin.close()
        self.process.wait(timeout=120)


def parse_cores(spec: str) -> set[int]:
    """``"1"``, ``"0-1"`` or ``"0,2-3"`` -> the set of core ids."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def vllm_env(cores: set[int], plugins: bool = True) -> dict[str, str]:
    """vLLM's CPU backend environment (as integrations/vllm/ci.sh sets it), its OpenMP threads bound to ``cores``;
    ``plugins=False``: vLLM loads no plugin (``VLLM_PLUGINS=none``), dmtp-vllm's included."""
    bind = ",".join(map(str, sorted(cores)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=bind)
    preload = [str(p) for p in Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4")][:1]
    preload += [str(p) for p in (REPO / ".venv-vllm" / "lib").glob("libiomp5.so")]
    env["LD_PRELOAD"] = " ".join(preload)
    if plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = "none"
    return env


def interleaved(workers: dict[str, Worker], jobs: list[list[dict]], rounds: int = 1) -> dict[str, list[dict]]:
    """Every job on every worker, the method order rotating from job to job; answers by label, in job order."""
    labels = list(workers)
    answers: dict[str, list[dict]] = {label: [] for label in labels}
    for r in range(rounds):
        for j, job in enumerate(jobs):
            shift = (j + r) % len(labels)
            for label in labels[shift:] + labels[:shift]:
                answers[label].append(workers[label].run(job))
    return answers


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}
