"""What the DMTP policy chose in a running engine, read from its workers: ``llm.collective_rpc("dmtp_policy_report")``
(the hook gives vLLM's workers this function as a method); and what a drafter proposed, DMTP's or vLLM's own
(``DMTP_VLLM_PROPOSAL_LOG=1``, ``collective_rpc("dmtp_proposal_log")``), so tests compare two engines' proposals at
the same positions (DMTP's T1 against vLLM's ``mtp`` method's first token, say)."""

from __future__ import annotations

import functools
from dataclasses import asdict
from typing import Any

__all__ = ["log_own_proposals", "policy_report", "proposal_log", "record_proposals"]


def policy_report(worker: Any) -> dict[str, Any] | None:
    """One worker's DMTP policy: its counters (steps, plain steps, rows, rows that verified prompt lookup, proposals
    verified, drafted steps, blocks, probes, rows per width) and its current estimates (acceptance per position of
    the draft and of prompt lookup, the step cost curve). ``None`` where the worker runs no DMTP policy."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    policy = getattr(drafter, "policy", None)
    if policy is None:
        return None
    return {
        "counters": asdict(policy.counters),
        "draft_acceptance": list(policy.draft.prior),
        "lookup_acceptance": None if policy.lookup is None else list(policy.lookup.prior),
        "step_seconds": {  # per batch-size bucket: tokens verified -> seconds
            str(size): {str(t): s * costs.load for t, s in sorted(costs.points.items())}
            for size, costs in sorted(policy.bucket_costs.items())
        },
        "stage_seconds": {str(size): dict(stages) for size, stages in sorted(policy.bucket_stages.items())},
        "guard_backoffs": policy.guard.backoffs,
        "race_backoffs": policy.race.backoffs,  # free windows against plain windows by the clock (race.PlainRace)
        "race_ratios": [round(r, 3) for r in policy.race.ratios],
        "guard_windows": list(policy.guard.windows)[-16:],  # drafted windows: committed over plain steps' tokens
        "spent": dict(policy.spent),  # seconds of every step, and of the stages cost probes ran
        "profile": drafter.profile,  # seconds per part of the round, summed (DMTP_VLLM_PROFILE=1), else None
    }


def proposal_log(worker: Any) -> list[tuple[str, int, list[int]]] | None:
    """One worker's drafted rows ``(request, position of the token they follow, proposals)`` since the engine started
    (``DMTP_VLLM_PROPOSAL_LOG=1``; else ``None``): ``llm.collective_rpc("dmtp_proposal_log")``."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    log = getattr(drafter, "proposal_log", None)
    return None if log is None else list(log)


def record_proposals(
    log: list[tuple[str, int, list[int]]],
    requests: list[str],
    proposals: Any,
    target_positions: Any,
    token_indices_to_sample: Any,
    common_attn_metadata: Any,
) -> None:
    """Append each request's drafted row ``proposals`` ``[B, k]`` to ``log``, keyed by the position of the last token it
    follows (the bonus's: one past the last processed position of the request; a host sync)."""
    if token_indices_to_sample is None:
        token_indices_to_sample = common_attn_metadata.query_start_loc[1:] - 1
    positions = (target_positions[token_indices_to_sample] + 1).tolist()
    for request, position, row in zip(requests, positions, proposals.tolist(), strict=True):
        log.append((request, position, row))


def log_own_proposals(runner: Any) -> None:
    """Give vLLM's own drafter of ``runner`` (EAGLE, MTP, DFlash) a ``proposal_log`` that every ``propose`` fills."""
    drafter = runner.drafter
    drafter.proposal_log = []
    propose = drafter.propose

    @functools.wraps(propose)
    def logged(*args: Any, **kwargs: Any) -> Any:
        proposals = propose(*args, **kwargs)
        cad = kwargs["common_attn_metadata"]
        requests = list(runner.input_batch.req_ids[: cad.batch_size()])
        record_proposals(
            drafter.proposal_log,
            requests,
            proposals,
            kwargs["target_positions"],
            kwargs["token_indices_to_sample"],
            cad,
        )
        return proposals

    drafter.propose = logged
