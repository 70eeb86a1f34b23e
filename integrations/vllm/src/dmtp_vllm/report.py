"""What the DMTP policy chose in a running engine, read from its workers: ``llm.collective_rpc("dmtp_policy_report")``
(the hook gives vLLM's workers this function as a method)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

__all__ = ["policy_report"]


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
        "step_seconds": {str(t): s * policy.costs.load for t, s in sorted(policy.costs.points.items())},
        "stage_seconds": dict(policy.stage_seconds),
        "guard_backoffs": policy.guard.backoffs,
    }
