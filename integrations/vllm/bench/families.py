"""What vLLM's CPU build runs of each native-MTP family: tiny checkpoints in each family's real layout
(`dmtp_hf_assets.tiny_targets`, shaped for vLLM's CPU kernels), each served plainly, with vLLM's own ``mtp`` method
and with DMTP, the draft made as a user makes one from a z-lab DFlash checkpoint (a random DFlash draft in z-lab's
layout, continued into a DMTP draft whose head is the target's own for three training steps,
`dmtp_hf_assets.tiny_targets.continue_into_dmtp`, exported by ``dmtp convert --to vllm``), every engine in its own
process so that one that fails to start cannot take the others down. Each engine decodes `PROMPTS`, the first alone
(batch 1) and all four together.

Per family it records whether each engine runs, the exact error where one does not (the root cause from the
engine's log, and the function it came from), whether ``mtp``'s greedy tokens equal plain's, whether DMTP's equal
plain's (fp32) or ``mtp``'s (bf16: there plain and speculative steps run different kernels, and a random tiny model's
near-ties break differently between them, while two speculative engines verify alike), and whether vLLM's plain
greedy tokens equal Transformers' on the same checkpoint (fp32 families only: in bf16 two correct implementations
may break near-ties differently). Prints the table, writes ``reports/vllm/families.json``.

    .venv-vllm/bin/python integrations/vllm/bench/families.py        # after `make test-vllm`, about 8 minutes

Standard library only here; the probes run in vLLM's environment, the checkpoints and Transformers' reference in
dmtp-hf's (``$DMTP_HF_PYTHON``, default the repository's ``.venv``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers import REPO, VLLM_PYTHON, vllm_env  # noqa: E402

HF_PYTHON = os.environ.get("DMTP_HF_PYTHON", str(REPO / ".venv" / "bin" / "python"))
FAMILIES = ("mimo", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5", "qwen3_5_moe")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [30, 31]]
PROMPT = PROMPTS[0]
NEW_TOKENS = 12
# How each family's engines run here. GatedDeltaNet families: vLLM's CPU GDN kernel takes bf16 only, and with
# prefix caching a speculative engine copies the linear-attention state with a Triton kernel (`mamba_utils`'s
# `precopy_mamba_align_fused_kernel`), which the CPU build lacks; so they run in bf16 without prefix caching, and
# the survey records the error prefix caching gives.
GATED_DELTA_NET = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Lines of an engine's log that wrap the root cause rather than state it.
WRAPPERS = (
    "Tokenizer not available",
    "Engine core initialization failed",
    "EngineCore encountered an issue",
    "Worker failed with error",
    "Error raised in subprocess",
    "returned non-zero exit status",
    "failed to be inspected",
)
ERROR_LINE = re.compile(r"\b([A-Za-z_]*(?:Error|Exception)): (.+)$")
FRAME_LINE = re.compile(r'File "(?!<frozen)(?:[^"]*site-packages/)?([^"]*)", line \d+, in (\w+)')


def engine_settings(family: str) -> dict:
    """dtype and prefix caching of ``family``'s engines here (`GATED_DELTA_NET`)."""
    if family in GATED_DELTA_NET:
        return {"dtype": "bfloat16", "prefix_caching": False}
    return {"dtype": "float32", "prefix_caching": True}


def make_targets(directory: Path, families: list[str]) -> dict[str, dict]:
    """Each family's tiny vLLM-shaped checkpoint under ``directory``, its DMTP draft (from a z-lab DFlash checkpoint)
    exported for vLLM, and Transformers' greedy tokens for `PROMPT` (fp32), from dmtp-hf's environment."""
    script = f"""
import json, sys, torch
from dmtp_hf.cli import main as dmtp
from dmtp_hf_assets.tiny_targets import continue_into_dmtp, load_tiny_target, make_tiny_dflash_draft, make_tiny_target
out = {{}}
for family in {list(families)!r}:
    root = {str(directory)!r} + "/" + family
    path = make_tiny_target(family, root + "/target", vllm_kernels=True)
    make_tiny_dflash_draft(path, root + "/dflash")  # a z-lab DFlash checkpoint ...
    draft = continue_into_dmtp(path, root + "/dflash", root + "/run")  # ... continued into DMTP for 3 steps
    dmtp(["convert", str(draft), root + "/dmtp-vllm", "--to", "vllm", "--target", str(path)])
    model = load_tiny_target(path).eval()
    ids = model.generate(torch.tensor([{PROMPT!r}]), max_new_tokens={NEW_TOKENS}, do_sample=False,
                         min_new_tokens={NEW_TOKENS})
    out[family] = {{"path": str(path), "draft": root + "/dmtp-vllm", "transformers": ids[0, {len(PROMPT)}:].tolist()}}
print("@@ " + json.dumps(out))
"""
    done = subprocess.run([HF_PYTHON, "-c", script], capture_output=True, text=True, cwd=REPO)
    return json.loads(answer_line(done.stdout, done.stderr))


def probe(
    path: str,
    family: str,
    method: str,
    prefix_caching: bool | None = None,
    draft: str | None = None,
    engine: dict | None = None,
    environ: dict[str, str] | None = None,
) -> dict:
    """One engine for the checkpoint at ``path`` (``method``: ``"plain"``, ``"mtp"``, ``"ngram"``, or ``"dmtp"`` with
    the vLLM folder ``draft``), in its own process: ``{"ok": True, "tokens": [...], "batch": [[...], ...]}``
    (`PROMPT` alone, `PROMPTS` together) or ``{"ok": False, "error": root cause, "raised_in": function}``.
    ``engine``: settings that replace `engine_settings`' (``dtype``, ``prefix_caching``); ``environ``: variables for
    the engine's process."""
    settings = {**engine_settings(family), **(engine or {})}
    if prefix_caching is not None:
        settings["prefix_caching"] = prefix_caching
    if draft is not None:
        settings["draft"] = draft
    command = [str(VLLM_PYTHON), __file__, "--probe", path, "--method", method, "--settings", json.dumps(settings)]
    env = {**vllm_env(set(range(os.cpu_count()))), **(environ or {})}
    if method != "plain":  # what the drafter proposed at each position (`first_candidates`)
        env["DMTP_VLLM_PROPOSAL_LOG"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    try:
        return json.loads(answer_line(done.stdout, ""))
    except RuntimeError:
        return {"ok": False, **root_cause(done.stdout + "\n" + done.stderr)}


def root_cause(log: str) -> dict:
    """The first error line of an engine's log that is not a wrapper (`WRAPPERS`), and the file and function of the
    last frame of vLLM's own code before it."""
    lines = log.splitlines()
    for index, line in enumerate(lines):
        match = ERROR_LINE.search(line)
        if match is None or any(wrapper in line for wrapper in WRAPPERS):
            continue
        frames = [FRAME_LINE.search(earlier) for earlier in lines[max(0, index - 40) : index]]
        frames = [frame for frame in frames if frame is not None]
        frames = [frame for frame in frames if frame.group(1).startswith("vllm/")] or frames  # vLLM's own, if any
        raised_in = f"{frames[-1].group(1)}: {frames[-1].group(2)}" if frames else ""
        return {"error": f"{match.group(1)}: {match.group(2).strip()}", "raised_in": raised_in}
    return {"error": "no error line in the log: " + (lines[-1] if lines else "(empty)"), "raised_in": ""}


def survey(
    families: list[str], directory: Path, engine: dict | None = None, environ: dict[str, str] | None = None
) -> dict[str, dict]:
    """Every family's row (module docstring); ``engine`` and ``environ`` as `probe` takes them, for every engine."""
    targets = make_targets(directory, families)
    rows = {}
    for family in families:
        path, reference = targets[family]["path"], targets[family]["transformers"]
        settings = {**engine_settings(family), **(engine or {})}
        options = {"engine": engine, "environ": environ}
        row = {"settings": settings, "plain": probe(path, family, "plain", **options)}
        row["mtp"] = probe(path, family, "mtp", **options)
        row["dmtp"] = probe(path, family, "dmtp", draft=targets[family]["draft"], **options)
        plain, mtp, dmtp = row["plain"], row["mtp"], row["dmtp"]
        if family in GATED_DELTA_NET and mtp["ok"] and not settings["prefix_caching"]:
            row["mtp_with_prefix_caching"] = probe(path, family, "mtp", prefix_caching=True, **options)
        row["mtp_identical_to_plain"] = same_tokens(plain, mtp)
        fp32 = settings["dtype"] == "float32"
        row["dmtp_compared_with"] = "plain" if fp32 else "mtp"
        row["dmtp_identical"] = same_tokens(plain if fp32 else mtp, dmtp)
        row["t1_identical_to_mtp"] = _same_first_candidates(mtp, dmtp)
        row["plain_equals_transformers"] = plain["tokens"] == reference if fp32 and plain["ok"] else None
        row["transformers"] = reference
        row["path"] = path
        rows[family] = row
    return rows


def same_tokens(first: dict, second: dict) -> bool | None:
    """Whether two engines decoded the same greedy tokens, alone and in the batch (None: one did not run)."""
    if not (first["ok"] and second["ok"]):
        return None
    return first["tokens"] == second["tokens"] and first["batch"] == second["batch"]


def _same_first_candidates(mtp: dict, dmtp: dict) -> dict | None:
    """Where both engines drafted after the same token of the same request: how many such positions, and whether
    DMTP's T1 was vLLM ``mtp``'s first proposal at every one (None: one did not run)."""
    if not (mtp["ok"] and dmtp["ok"]):
        return None
    common = mtp["first_candidates"].keys() & dmtp["first_candidates"].keys()
    same = all(mtp["first_candidates"][key] == dmtp["first_candidates"][key] for key in common)
    return {"positions": len(common), "identical": same}


def table(rows: dict[str, dict]) -> str:
    """The survey as a Markdown table."""

    def cell(result: dict) -> str:
        return "runs" if result["ok"] else f"`{result['error'][:110]}` (`{result['raised_in']}`)"

    def flag(value: bool | None, why: str) -> str:
        return why if value is None else ("yes" if value else "**no**")

    out = [
        "| family | engine | plain | `mtp` | DMTP (dmtp-vllm) | `mtp` greedy = plain | DMTP greedy = | "
        "plain = Transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, row in rows.items():
        settings = row["settings"]
        engine = settings["dtype"] + ("" if settings["prefix_caching"] else ", no prefix caching")
        mtp = cell(row["mtp"])
        if "mtp_with_prefix_caching" in row and not row["mtp_with_prefix_caching"]["ok"]:
            mtp += f"; with prefix caching: {cell(row['mtp_with_prefix_caching'])}"
        if not row["plain"]["ok"] and row["mtp"] == row["plain"]:
            mtp = "the same"
        versus = "n/a (bf16)" if settings["dtype"] != "float32" else "n/a"
        dmtp = f"{row['dmtp_compared_with']}: {flag(row['dmtp_identical'], 'n/a')}"
        first = row.get("t1_identical_to_mtp")
        if first is not None:
            dmtp += f"; T1 = `mtp`'s first token at {first['positions']} positions: {flag(first['identical'], 'n/a')}"
        out.append(
            f"| {family} | {engine} | {cell(row['plain'])} | {mtp} | {cell(row['dmtp'])} "
            f"| {flag(row['mtp_identical_to_plain'], 'n/a')} | {dmtp} "
            f"| {flag(row['plain_equals_transformers'], versus)} |"
        )
    return "\n".join(out)


def answer_line(stdout: str, stderr: str) -> str:
    """A worker process's answer: its ``@@ `` line, without the marker (``RuntimeError`` with the end of ``stderr``
    when there is none)."""
    for line in stdout.splitlines():
        if line.startswith("@@ "):
            return line[3:]
    raise RuntimeError(f"no answer line; stderr ends: {stderr[-2000:]}")


def tiny_engine(path: str, settings: dict, speculative: dict | None, max_num_seqs: int = 4) -> Any:
    """A vLLM engine for a tiny checkpoint as these probes run one: eager, no tokenizer (token-id prompts), small
    caches, ``settings``' dtype and prefix caching, the speculative counters kept (vLLM's environment only)."""
    from vllm import LLM

    return LLM(
        model=path,
        dtype=settings["dtype"],
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=settings["prefix_caching"],
        speculative_config=speculative,
        seed=0,
        enforce_eager=True,
        skip_tokenizer_init=True,
        disable_log_stats=False,
    )


def _run_probe(path: str, method: str, settings: dict) -> None:
    """In a probe's own process (vLLM's environment): start the engine, decode `PROMPT` alone and `PROMPTS`
    together greedily, answer."""
    from vllm import SamplingParams, TokensPrompt

    speculative = None
    if method == "mtp":
        speculative = {"method": "mtp", "num_speculative_tokens": 1}
    elif method == "dmtp":
        speculative = {"method": "dflash", "model": settings["draft"], "num_speculative_tokens": 7}
    elif method == "ngram":  # on these prompts mostly no proposal: steps where a request verifies none
        speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 2}

    engine = tiny_engine(path, settings, speculative)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    alone = engine.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    together = engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    answer = {"ok": True, "tokens": list(alone[0].outputs[0].token_ids)}
    answer["batch"] = [list(out.outputs[0].token_ids) for out in together]
    if speculative is not None:  # "alone/0@p" or "batch/i@p" -> the first token proposed after position p - 1
        names = {alone[0].request_id: "alone/0", **{out.request_id: f"batch/{i}" for i, out in enumerate(together)}}
        log = engine.collective_rpc("dmtp_proposal_log")[0] or []
        # vLLM's internal request ids are the caller's with "-" and 8 random characters appended
        answer["first_candidates"] = {f"{names[r.rsplit('-', 1)[0]]}@{p}": row[0] for r, p, row in log if row}
    print("@@ " + json.dumps(answer), flush=True)


def main() -> None:
    """The survey (or, with ``--probe``, one engine)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--output", type=Path, default=REPO / "reports" / "vllm" / "families.json")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        _run_probe(args.probe, args.method, json.loads(args.settings))
        return
    with tempfile.TemporaryDirectory() as directory:
        rows = survey(args.families.split(","), Path(directory))
    print(table(rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
