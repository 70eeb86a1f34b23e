"""Fixtures of the dmtp-vllm tests: SmolLM2-135M-Instruct with the drafts bundled in dmtp-hf, exported for vLLM.

These tests run in vLLM's environment (``integrations/vllm/ci.sh`` builds it). What needs dmtp-hf (the export, the
reference decode) runs in dmtp-hf's own environment, ``$DMTP_HF_PYTHON`` (default: the repository's ``.venv``).
The target is the one ``make smollm2`` sets up (``$DMTP_VLLM_TARGET``, default ``~/.cache/dmtp_hf/smollm2``).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BUNDLE = REPO / "assets" / "dmtp_hf_assets" / "models" / "smollm2"  # the repository-local assets package
HF_PYTHON = os.environ.get("DMTP_HF_PYTHON", str(REPO / ".venv" / "bin" / "python"))
TARGET = Path(os.environ.get("DMTP_VLLM_TARGET", Path.home() / ".cache" / "dmtp_hf" / "smollm2"))
DATA = REPO / "src" / "dmtp_hf" / "evaluation" / "data"


def hf(*args: str) -> None:
    """Run dmtp-hf's Python with ``args`` (the export and the reference decode)."""
    subprocess.run([HF_PYTHON, *args], check=True, cwd=REPO)


@pytest.fixture(scope="session")
def target() -> Path:
    """The SmolLM2 target directory (``make smollm2``)."""
    if not (TARGET / "config.json").is_file():
        raise FileNotFoundError(f"No SmolLM2 target in {TARGET}: run `make smollm2` (or set DMTP_VLLM_TARGET)")
    return TARGET


@pytest.fixture(scope="session")
def exported(tmp_path_factory, target) -> dict[str, Path]:
    """The bundled DMTP draft (with its retrofitted head) and DFlash draft as vLLM folders."""
    out = tmp_path_factory.mktemp("drafts")
    common = ["--target", str(target)]
    hf(
        "-m",
        "dmtp_hf.cli",
        "convert",
        str(BUNDLE / "dmtp"),
        str(out / "dmtp"),
        "--to",
        "vllm",
        "--mtp-head",
        str(BUNDLE / "mtp_head"),
        *common,
    )
    hf("-m", "dmtp_hf.cli", "convert", str(BUNDLE / "dflash"), str(out / "dflash"), "--to", "dflash", *common)
    return {"dmtp": out / "dmtp", "dflash": out / "dflash"}


def first_turns(name: str, count: int) -> list[str]:
    """The first user turn of the first ``count`` prompts of a bundled evaluation set."""
    with open(DATA / f"{name}.jsonl") as f:
        return [json.loads(line)["turns"][0] for line in f][:count]


@pytest.fixture(scope="session")
def prompts(target) -> list[dict]:
    """16 chat prompts (GSM8K, HumanEval, MT-Bench first turns) as token ids, with budgets from 24 to 64 tokens so
    that requests of one batch finish at different steps."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = first_turns("gsm8k", 6) + first_turns("humaneval", 5) + first_turns("mt_bench", 5)
    return [
        {
            "prompt_token_ids": tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            ),
            "max_tokens": 24 + 8 * (i % 6),
        }
        for i, text in enumerate(texts)
    ]


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory, target, prompts) -> list[dict]:
    """dmtp-hf's own DMTP decode of the same prompts (tests/hf_reference.py)."""
    out = tmp_path_factory.mktemp("reference")
    (out / "prompts.json").write_text(json.dumps(prompts))
    hf(
        str(Path(__file__).parent / "hf_reference.py"),
        "--target",
        str(target),
        "--draft",
        str(BUNDLE / "dmtp"),
        "--mtp-head",
        str(BUNDLE / "mtp_head"),
        "--prompts",
        str(out / "prompts.json"),
        "--out",
        str(out / "reference.json"),
    )
    return json.loads((out / "reference.json").read_text())


# What the DMTP proposer reads from the environment when an engine's workers start (make_engine sets or clears each).
PLUGIN_ENVIRONMENT = (
    "DMTP_VLLM_VERIFY",
    "DMTP_VLLM_LEAN_STEPS",
    "DMTP_VLLM_PROPOSAL_LOG",
    "DMTP_VLLM_MODELED_COSTS",
)


def make_engine(
    target: Path,
    speculative_config: dict | None,
    max_num_seqs: int = 16,
    eager: bool = True,
    verify: str | None = None,
    environ: dict[str, str] | None = None,
):
    """A small fp32 vLLM engine on this CPU (prefix caching on). ``eager``: no torch.compile, which costs a minute
    or more per engine on two cores; the acceptance test runs vLLM's compiled default. ``verify``: the DMTP policy
    (``"all"`` or ``"adaptive"``; its workers read it from the environment when they start), else the plugin's
    default; ``environ``: other ``PLUGIN_ENVIRONMENT`` variables for its workers (the rest are cleared)."""
    from vllm import LLM

    settings = {"DMTP_VLLM_VERIFY": verify, **(environ or {})}
    for name in PLUGIN_ENVIRONMENT:
        if settings.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = settings[name]
    return LLM(
        model=str(target),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=True,
        speculative_config=speculative_config,
        seed=0,
        enforce_eager=eager,
        disable_log_stats=False,  # the speculative-decoding counters
    )


def close(engine) -> None:
    """Stop an engine's processes before the next one starts (two cores, little memory to spare)."""
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()
