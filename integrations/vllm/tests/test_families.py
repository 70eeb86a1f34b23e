"""What vLLM's CPU build runs of each native-MTP family (``bench/families.py``): tiny checkpoints in each family's
real layout, shaped for vLLM's CPU kernels, served plainly, with vLLM's own ``mtp`` method and with DMTP (the plugin
running the family's own vLLM MTP model with the target's weights). The table in
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
    """Every family's row, each engine in its own process (about 7 minutes)."""
    return families.survey(list(families.FAMILIES), tmp_path_factory.mktemp("families"))


def test_families_that_run_here_serve_plainly_and_with_their_own_mtp_head(survey):
    """MiMo, GLM-4-MoE, DeepSeek-V3 (once its router is named as the releases name it) and Qwen3-Next start, decode
    plainly and decode with vLLM's `mtp` method."""
    for family in RUN_HERE:
        row = survey[family]
        assert row["plain"]["ok"] and row["mtp"]["ok"], (family, row)
        assert len(row["mtp"]["tokens"]) == families.NEW_TOKENS, (family, row)


def test_vllm_mtp_is_greedy_identical_to_plain_where_the_head_runs_in_standard_attention(survey):
    """MiMo and GLM-4-MoE (fp32, GQA attention): the head's proposals change nothing, the first prompt alone and four
    together. Qwen3-Next (bf16, GatedDeltaNet trunk, full-attention head): the first prompt alone; in the batch one
    request meets an exact bf16 tie of the random tiny model (two tokens at -2.9586) that the speculative and the plain
    step break differently. (DeepSeek-V3's MLA is not held to it: on this CPU build its greedy `mtp` tokens differ
    from plain ones on the tiny checkpoint, as the README's table says.)"""
    for family in ("mimo", "glm4_moe"):
        assert survey[family]["mtp_identical_to_plain"], (family, survey[family])
    row = survey["qwen3_next"]
    assert row["mtp"]["tokens"] == row["plain"]["tokens"], row


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


def test_dmtp_serves_qwen3_next_with_the_targets_own_head_as_vllms_mtp_decodes(survey):
    """Qwen3-Next (GatedDeltaNet trunk, bf16): DMTP's T1 comes from vLLM's Qwen3-Next MTP model loaded from the target
    checkpoint (the draft folder holds no copy): T1 is the first token vLLM's own `mtp` method proposes at every
    position both drafted at, and DMTP's greedy tokens equal `mtp`'s, the first prompt alone and four together.
    (Against plain decoding, bf16 near-ties of the random tiny model break differently in speculative and plain
    steps, for vLLM's `mtp` as for DMTP.)"""
    row = survey["qwen3_next"]
    assert row["dmtp"]["ok"], row["dmtp"]
    assert row["dmtp_compared_with"] == "mtp" and row["dmtp_identical"], row
    # the same head gives the same first token: DMTP's T1 is `mtp`'s proposal wherever both drafted after one token
    assert row["t1_identical_to_mtp"]["identical"] and row["t1_identical_to_mtp"]["positions"] >= 40, row
    assert len(row["dmtp"]["batch"]) == len(families.PROMPTS)


def test_dmtp_is_refused_or_fails_by_name_where_vllm_cannot_serve_it(survey):
    """MiMo and GLM-4-MoE: vLLM's models of these targets hand a DFlash drafter none of their layers, and the plugin
    refuses the draft before the target loads, naming the model. DeepSeek-V3: its MLA head and the block's attention
    share no KV cache block size on this CPU build."""
    for family in ("mimo", "glm4_moe"):
        dmtp = survey[family]["dmtp"]
        assert not dmtp["ok"] and "cannot serve a DFlash or DMTP draft" in dmtp["error"], (family, dmtp)
    dmtp = survey["deepseek_v3"]["dmtp"]
    assert not dmtp["ok"] and "No common block size" in dmtp["error"], dmtp
