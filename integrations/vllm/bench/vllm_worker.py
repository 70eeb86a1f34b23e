"""One vLLM engine as a benchmark worker: reads jobs as JSON lines on stdin, answers each on stdout.

Started by ``compare.py`` with vLLM's environment (``.venv-vllm``). The first line it prints is ``{"ready": ...}``
once the engine is up (weights loaded, compiled, warmed up; every answer line starts with ``@@ `` because vLLM's own
logs share stdout); then, per job ``{"prompts": [{"prompt_token_ids",
"max_tokens"}]}`` (submitted together: vLLM batches them), it prints the greedy tokens, the job's wall time and the
speculative-decoding counters it added (``drafts``: verify rounds that carried proposals, ``accepted``, and
``per_pos``: rounds that accepted at least i + 1 proposals) and, with ``--policy-report``, the DMTP policy's
counters over the job (``dmtp_vllm.report``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def answer(message: dict) -> None:
    """One answer line for the orchestrator (marked: vLLM logs to the same stdout)."""
    print("@@ " + json.dumps(message), flush=True)


def counters(engine) -> dict:
    """Cumulative speculative-decoding counters (zeros for an engine without a drafter)."""
    metrics = {m.name: m for m in engine.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in metrics:
        return {"drafts": 0, "accepted": 0, "per_pos": []}
    return {
        "drafts": metrics["vllm:spec_decode_num_drafts"].value,
        "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value,
        "per_pos": list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    }


def policy_counters(engine) -> dict:
    """The DMTP policy's cumulative counters, from the engine's worker (``dmtp_vllm.report``)."""
    return engine.collective_rpc("dmtp_policy_report")[0]["counters"]


def policy_difference(after: dict, before: dict) -> dict:
    """What the policy chose during one job (its scalar counters, differenced)."""
    return {key: value - before[key] for key, value in after.items() if isinstance(value, int)}


def difference(after: list[int], before: list[int]) -> list[int]:
    """Per-position counters added between two readings (a counter vector grows when a position first counts)."""
    before = before + [0] * (len(after) - len(before))
    return [a - b for a, b in zip(after, before, strict=True)]


def main() -> None:
    """Serve jobs until stdin closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--speculative-config", default=None, help="JSON, as vLLM's --speculative-config")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (minutes per engine)")
    parser.add_argument("--policy-report", action="store_true", help="answer with the DMTP policy's counters too")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = LLM(
        model=args.target,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=384 << 20,
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
        enforce_eager=args.eager,
    )
    engine.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=8), use_tqdm=False)
    answer({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("report"):  # what the DMTP policy chose and estimates now (dmtp_vllm.report), no decoding
            answer({"report": engine.collective_rpc("dmtp_policy_report")[0]})
            continue
        prompts = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in job["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"]) for p in job["prompts"]]
        before = counters(engine)
        policy_before = policy_counters(engine) if args.policy_report else None
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = counters(engine)
        answer(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "seconds": seconds,
                "drafts": after["drafts"] - before["drafts"],
                "accepted": after["accepted"] - before["accepted"],
                "per_pos": difference(after["per_pos"], before["per_pos"]),
                "policy": policy_difference(policy_counters(engine), policy_before) if args.policy_report else None,
            }
        )


if __name__ == "__main__":
    main()
