"""What vLLM's CPU build runs of each native-MTP family (``bench/families.py``): tiny checkpoints in each family's
real layout, shaped for vLLM's CPU kernels, served plainly and with vLLM's own ``mtp`` method. The table in
``integrations/vllm/README.md`` says the same; when one of these fails because vLLM changed (a family that now runs,
or fails otherwise), rerun ``.venv-vllm/bin/python integrations/vllm/bench/families.py`` and update the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import families  # noqa: E402

# Families whose plain decoding and vLLM `mtp` method run on this CPU build (GatedDeltaNet ones in bf16, without
# prefix caching: `families.engine_settings`).
RUN_HERE = ("mimo", "glm4_moe", "deepseek_v3", "qwen3_next")


@pytest.fixture(scope="module")
def survey(tmp_path_factory) -> dict[str, dict]:
    """Every family's row, each engine in its own process (about 5 minutes)."""
    return families.survey(list(families.FAMILIES), tmp_path_factory.mktemp("families"))


def test_families_that_run_here_serve_plainly_and_with_their_own_mtp_head(survey):
    """MiMo, GLM-4-MoE, DeepSeek-V3 (once its router is named as the releases name it) and Qwen3-Next start, decode
    plainly and decode with vLLM's `mtp` method."""
    for family in RUN_HERE:
        row = survey[family]
        assert row["plain"]["ok"] and row["mtp"]["ok"], (family, row)
        assert len(row["mtp"]["tokens"]) == families.NEW_TOKENS, (family, row)


def test_vllm_mtp_is_greedy_identical_to_plain_where_the_head_runs_in_standard_attention(survey):
    """MiMo and GLM-4-MoE (fp32, GQA attention) and Qwen3-Next (bf16, GatedDeltaNet trunk, full-attention head): the
    head's proposals change nothing. (DeepSeek-V3's MLA is not held to it: on this CPU build its greedy `mtp`
    tokens differ from plain ones on the tiny checkpoint, as the README's table says.)"""
    for family in ("mimo", "glm4_moe", "qwen3_next"):
        assert survey[family]["mtp_identical_to_plain"], (family, survey[family])


def test_vllm_reads_the_tiny_checkpoints_as_transformers_does(survey):
    """vLLM's plain greedy tokens equal Transformers' on the same fp32 checkpoint: the tiny layouts are real enough
    that both libraries build the same model from them."""
    for family in ("mimo", "glm4_moe"):
        assert survey[family]["plain_equals_transformers"], (family, survey[family])


def test_families_blocked_here_fail_with_their_known_error(survey):
    """The README's table says why the others do not run here; the errors are still those."""
    for family in ("qwen3_5", "qwen3_5_moe"):  # vLLM's Qwen3.5 module imports torchvision: no CPU wheel on PyPI
        plain = survey[family]["plain"]
        assert not plain["ok"] and "torchvision" in plain["error"], (family, plain)
    # with prefix caching, a speculative hybrid engine copies the linear-attention state with a Triton kernel
    with_prefix_caching = survey["qwen3_next"]["mtp_with_prefix_caching"]
    assert not with_prefix_caching["ok"], with_prefix_caching
    assert with_prefix_caching["raised_in"].endswith("run_fused_precopy"), with_prefix_caching
