"""The speculation policy both engines share: which proposals a round verifies, and how many.

``generate``'s ``verify_length="auto"`` and the vLLM plugin ask the same questions of the same pieces:

- `acceptance`: what a proposal is expected to commit (the draft's calibrated confidence, or what rounds accepted).
- `costs`: what a step over T tokens costs, learned from the steps the engine runs.
- `planner`: the widths (one per request, or one for a padded batch) and the source per request (the draft's
  block or prompt lookup) that maximise expected tokens per second.
- `lookup`: prompt-lookup proposals, found as vLLM's n-gram proposer finds them.
- `guard`: the guard rail: what drafted rounds really committed per second, against plain steps.
- `race`: windows of free choice against windows of plain steps, by the clock (the engine's backstop).
- `requests`: the per-request policy of an engine step (vLLM), put together from the above.

Pure torch and the standard library (no Transformers): the vLLM plugin imports it from vLLM's own environment.
"""

from __future__ import annotations

from .acceptance import AcceptanceEstimate, Calibration, expected_commits, gains
from .costs import ModeledCosts, StepCosts
from .guard import GUARD_WINDOW, GuardRail
from .lookup import prompt_lookup
from .planner import Plan, allocate, best_uniform_width, choose_sources
from .race import PlainRace
from .requests import RequestPolicy, StepPlan

__all__ = [
    "GUARD_WINDOW",
    "AcceptanceEstimate",
    "Calibration",
    "GuardRail",
    "Plan",
    "ModeledCosts",
    "PlainRace",
    "RequestPolicy",
    "StepCosts",
    "StepPlan",
    "allocate",
    "best_uniform_width",
    "choose_sources",
    "expected_commits",
    "gains",
    "prompt_lookup",
]
