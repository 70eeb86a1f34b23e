"""The round policy of an engine that verifies a width per request (the vLLM plugin): which proposal each request
verifies, the draft's block or prompt lookup, and how many of them (0: a plain decoding step for that request).

Each engine step asks it, in order:

1. `drafts`: before the draft runs anything beyond what keeps its state current (the MTP head's layer, the block's
   context K/V): do the estimates say any request should verify the draft's proposals? When none should, T1 and the
   block are not computed and the step verifies prompt lookup alone where it pays, else nothing (plain decoding).
2. `wants_block`: with T1 and its confidence known, is the DFlash block worth its forward? (The best plan that
   verifies T1 alone, or prompt lookup, against the best over the whole block, charged the block's seconds.)
3. `choose`: with every confidence known, per request the source (`planner.choose_sources`) and the width
   (`planner.allocate`) that maximise expected tokens per second against the step cost curve (`costs.StepCosts`).

What teaches it: `learn` (the verify's accepted count per request, for the proposals it verified), `learn_judged`
(the drafted proposals nobody verified, judged later by the committed text: `ledger.ProposalLedger`, so the
estimates are not biased by what the policy chose to verify), `step_timed` (what the step cost: the curve, and the
guard rail, `guard.GuardRail`, which compares what drafted steps really committed per second with plain steps and
backs off to plain steps when drafting lost) and `stage_timed` (the drafter stages T1 and block). Behind both, the
race (`race.PlainRace`) compares by the clock what windows of the policy's free choice committed per second with
short windows of plain steps run next to them, and decodes plainly while drafting loses: estimates and guard price
steps, the race measures them.

Probes: when the draft does not pay (or the guard backs off), the draft's T1 still runs now and then (and the block,
when T1 runs but the block does not pay), its proposals judged by the text through the ledger, unverified: the
estimates keep following the text (an estimate that stopped at an unlucky low would never see the draft recover)
at the cost of a draft stage, never of a verify, and at most `EXPLORATION` of the time. While the guard backs off,
its own probes (at doubling intervals) verify what the estimates choose.
No clock is read here: the engine passes seconds, so tests drive it with injected costs.

The first steps of each batch-size bucket (1, 2, 3-4, 5-8, ...: the cost of T tokens depends on how many requests
share them) measure its curve: a plain step (T = B), then one that verifies one proposal per request (T = 2B); from
then on the curve is interpolated between the T seen, extrapolated past the widest with the slope of its last
segment, and every step keeps it current. The first wide step is one the curve so far says pays: where a token of
verify costs little (a GPU's flat curve) that comes at once; where every token costs (a CPU at 16 requests: 128
tokens took 4.7x a plain step), no step pays that much to learn it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .acceptance import AcceptanceEstimate, Calibration
from .costs import StepCosts
from .guard import GuardRail
from .ledger import Judged
from .planner import Plan, allocate, as_array, choose_sources
from .race import PlainRace

__all__ = ["DRAFT", "LOOKUP", "LOOKUP_PRIOR", "PolicyCounters", "RequestPolicy", "StepPlan"]

# Before any evidence, a prompt-lookup proposal is assumed accepted this often once the ones before it were.
LOOKUP_PRIOR = 0.6
# Probes run the draft although it does not pay (T1, or the block once T1 is drafted), its proposals judged by the
# text, unverified: at most EXPLORATION of the time, and never two within PROBE_INTERVAL steps.
EXPLORATION = 0.02
PROBE_INTERVAL = 2
# Steps without drafting between two that verify one request's whole block, when no wide step was measured lately
# (the curve's wide steps measured again): the first wait, doubling while drafting keeps not paying, up to the longest.
FIRST_COST_PROBE_INTERVAL = 32
MAX_COST_PROBE_INTERVAL = 256
# Plain steps between two probes of the guard rail while it backs off (each verifies the estimates' plan): the first
# wait, doubling while the probes lose, up to the longest.
FIRST_GUARD_INTERVAL = 2
MAX_GUARD_INTERVAL = 32
# Whether asking the draft pays is judged over these quantiles of the last T1_HISTORY confidences of T1.
T1_HISTORY = 256
T1_QUANTILES = [0.1, 0.3, 0.5, 0.7, 0.9]
# ... and judged again after this many steps (it moves with the estimates and the curve, which move slowly).
ASK_REFRESH = 8
STAGE_RATE = 0.2  # how fast measured drafter stage seconds move their running means
# The least weight of new evidence in the acceptance estimates: half ``generate``'s, because here every drafted
# proposal is judged (the ledger), so evidence is plentiful and a steadier estimate decides marginal cases better.
ESTIMATE_RATE = 0.02
# Steps the guard rail judges together: longer than ``generate``'s rounds, because the estimates here already follow
# acceptance request by request and the costs step by step; the guard is the backstop for what neither sees.
GUARD_STEPS = 24
# ... and drafting has lost only below plain steps' rate x (1 - GUARD_MARGIN): within it, a window's acceptance noise
# (a few proposals more or fewer accepted) would stop drafts that win by little.
GUARD_MARGIN = 0.05
DRAFT, LOOKUP = 0, 1  # source indices


def bucket(batch: int) -> int:
    """The batch-size bucket whose costs a step of ``batch`` requests shares: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class StepPlan:
    """What each request of the step verifies."""

    source: np.ndarray  # [B] DRAFT or LOOKUP
    widths: np.ndarray  # [B] proposals verified (0: a plain step for the request)

    def verified_from(self, source: int) -> np.ndarray:
        """``[B]`` how many of ``source``'s proposals each request verifies (the ledger judges the rest)."""
        return np.where(self.source == source, self.widths, 0)


@dataclass
class PolicyCounters:
    """What the policy chose, for reports."""

    steps: int = 0
    plain_steps: int = 0  # steps that verified nothing
    race_plain_steps: int = 0  # ... of them, forced by the race (`race.PlainRace`): plain windows and back-offs
    rows: int = 0
    lookup_rows: int = 0  # rows that verified prompt lookup
    verified: int = 0  # proposals verified
    drafted_steps: int = 0  # steps that asked the draft for T1
    blocks: int = 0  # steps that ran the draft's block
    probes: int = 0  # steps that ran the draft only for the ledger
    widths: dict[int, int] = field(default_factory=dict)  # width -> rows

    def add(self, plan: StepPlan) -> None:
        """Count one step's plan."""
        self.steps += 1
        self.rows += plan.widths.size
        verified = int(plan.widths.sum())
        self.verified += verified
        self.plain_steps += verified == 0
        self.lookup_rows += int(((plan.source == LOOKUP) & (plan.widths > 0)).sum())
        for width, count in zip(*np.unique(plan.widths, return_counts=True), strict=True):
            self.widths[int(width)] = self.widths.get(int(width), 0) + int(count)


class RequestPolicy:
    """Per-request sources and widths (module docstring). ``calibration``: the draft's stored one (its confidences
    per position -> acceptance); ``lookup``: whether prompt-lookup proposals compete with the draft's."""

    def __init__(self, num_candidates: int, calibration: Calibration | None = None, lookup: bool = True) -> None:
        self.num_candidates = num_candidates
        self.calibration = calibration or Calibration()
        start = self.calibration.base_rates or None
        self.estimates = {DRAFT: AcceptanceEstimate(num_candidates, start, rate=ESTIMATE_RATE)}
        if lookup:
            self.estimates[LOOKUP] = AcceptanceEstimate(num_candidates, [LOOKUP_PRIOR], rate=ESTIMATE_RATE)
        # per batch-size bucket (1, 2, 3-4, 5-8, ...): what a step over T tokens costs depends on how many requests
        # share it too (attention, sampling and bookkeeping per request), and so do the drafter's stages
        self.bucket_costs: dict[int, StepCosts] = {}
        self.bucket_stages: dict[int, dict[str, float]] = {}  # drafter stage -> running mean of its seconds
        self.batch = 1  # the step's batch size (what `stage_timed` files its seconds under)
        self.spent = {"total": 0.0, "probes": 0.0}  # seconds of every step, and of the stages probes ran
        self.guard = GuardRail(GUARD_STEPS, GUARD_MARGIN, priced_per_round=True)
        # by the clock: free windows against plain windows next to them (what neither estimates nor guard price)
        self.race = PlainRace()
        self.race_plain = False  # the race forced this step plain
        self.stage_seconds = 0.0  # drafter stages of the step being planned (its wall time besides the step's own)
        self.pending: dict[str, tuple[int, np.ndarray | None]] = {}  # request -> (source, confidences)
        self.planned: dict[str, int] = {}  # request -> the width planned for it last
        self.t1_confidences: deque[float] = deque(maxlen=T1_HISTORY)  # what T1's confidence was, lately
        self._asked: dict[tuple[int, int], tuple[bool, int]] = {}  # (batch, rows with lookup) -> (pays, at step)
        self.since_probe = 0  # steps since the draft last ran
        self.cost_probe = False  # this probe's step verifies one request's whole block (a wide step, measured)
        self.cost_probe_interval = FIRST_COST_PROBE_INTERVAL  # steps without drafting between two of them
        self.since_cost_probe = 0
        self.since_block = 0  # steps that drafted T1 since the block last ran
        self.block_probe = False  # this step's block runs for the ledger only
        self.probing = False  # this step runs the draft for the ledger, whatever the estimates
        self.plain = False  # this step verifies nothing (the guard rail backs off)
        self.guard_probe = False  # this step verifies the estimates' plan while the guard backs off
        self.guard_interval = FIRST_GUARD_INTERVAL  # plain steps between two guard probes
        self.since_guard_probe = 0
        self.judged = False  # the last step followed the estimates (the guard rail judges it)
        self.counters = PolicyCounters()

    @property
    def draft(self) -> AcceptanceEstimate:
        """What the draft's proposals are accepted per position."""
        return self.estimates[DRAFT]

    @property
    def lookup(self) -> AcceptanceEstimate | None:
        """What prompt-lookup proposals are accepted per position (``None``: lookup off)."""
        return self.estimates.get(LOOKUP)

    # -- what the last step showed -------------------------------------------------------------------------------

    def learn(self, request_ids: list[str], verified: Any, accepted: Any) -> None:
        """The last step's verdict per request of this step's batch: ``verified`` ``[B]`` proposals it verified (the
        scheduler may have cut a plan), ``accepted`` ``[B]`` of them accepted (tensors or arrays)."""
        if not self.pending:
            return
        verified, accepted = as_array(verified), as_array(accepted)
        rows: dict[int, list[tuple[int, np.ndarray | None]]] = {DRAFT: [], LOOKUP: []}
        for row, request in enumerate(request_ids):
            if request in self.pending:
                source, conf = self.pending.pop(request)
                rows[source].append((row, conf))
        for source, entries in rows.items():
            if entries and source in self.estimates:
                index = [row for row, _ in entries]
                confs = [c for _, c in entries]
                conf = np.stack(confs) if all(c is not None for c in confs) else None
                self.estimates[source].observe(verified[index], accepted[index], conf)
        self.pending.clear()

    def learn_judged(self, judged: list[Judged]) -> None:
        """Drafted proposals the committed text judged (`ledger.ProposalLedger`): each counts from its first
        unverified proposal, and only where the verified ones before it were all accepted."""
        groups: dict[tuple[int, int, bool], list[Judged]] = {}
        for item in judged:
            if item.source in self.estimates and item.matched >= item.first:
                groups.setdefault((item.source, item.first, item.conf is not None), []).append(item)
        for (source, first, with_conf), items in groups.items():
            self.estimates[source].observe(
                np.array([i.drafted - first for i in items]),
                np.array([i.matched - first for i in items]),
                np.stack([as_array(i.conf) for i in items]) if with_conf else None,
                first=first,
            )

    def step_timed(
        self, request_ids: list[str], tokens: int, seconds: float, committed: int, cycle_seconds: float | None = None
    ) -> None:
        """The last step ran ``tokens`` tokens in all for the requests ``request_ids`` and committed ``committed``,
        in ``seconds`` (everything between two steps but the drafter stages of `stage_timed`). Only a step that
        verified exactly what was planned for each of its requests is a verify of T tokens: one with a prefill or a
        request that joined teaches the curve nothing. ``cycle_seconds``: the engine's whole cycle since the last
        call, what the race (`race.PlainRace`) compares (default: ``seconds`` and the stages)."""
        batch = len(request_ids)
        planned = [self.planned.get(request) for request in request_ids]
        planned_tokens = None if None in planned else batch + sum(planned)
        self.spent["total"] += seconds
        if planned_tokens is not None:  # a step with a request that joined (its prefill) races nothing
            cycle = seconds + self.stage_seconds if cycle_seconds is None else cycle_seconds
            self.race.step(bucket(batch), batch, self.race_plain, committed, cycle)
        self.stage_seconds = 0.0
        if tokens == planned_tokens:
            self.costs(batch).observe(tokens, seconds)
            # the guard judges drafted steps that followed the estimates (not the first steps that measure) against
            # plain steps as the curve prices them now (it follows the load step by step; a plain step measured
            # long ago would not)
            if self.judged and tokens > batch:
                self.guard.stage("step", seconds)
                self.guard.committed(tokens - batch, committed)
        self.guard.begin_round(batch, lambda size: self.costs(size).seconds(size))

    def stage_timed(self, stage: str, seconds: float) -> None:
        """A drafter stage of this step took ``seconds``: ``"t1"`` (the head's T1 and its confidence) or
        ``"block"`` (the DFlash block); a probe's stages are what probing costs (`EXPLORATION`)."""
        self.counters.blocks += stage == "block"
        self.stage_seconds += seconds
        self.guard.stage(stage, seconds)  # the step these stages drafted for pays them: the guard's open round
        stages = self.bucket_stages.setdefault(bucket(self.batch), {})
        previous = stages.get(stage)
        stages[stage] = seconds if previous is None else previous + STAGE_RATE * (seconds - previous)
        self.spent["total"] += seconds
        if self.probing or (stage == "block" and self.block_probe):
            self.spent["probes"] += seconds

    # -- the step's questions ------------------------------------------------------------------------------------

    def plain_by_race(self, batch: int) -> bool:
        """Before anything else of a step of ``batch`` requests: will `drafts` make it plain by the race (a plain
        window measuring, or drafting lost by the clock)? Then nothing the draft computes this step is verified, and
        an engine may defer keeping the draft's state current until drafting resumes."""
        return self._exploring(batch) is None and self.race.plain_now(bucket(batch))

    def drafts(self, lookup_counts: Any) -> bool:
        """Before T1: is the draft worth asking this step (see the module docstring)? Sets whether the step may
        verify anything at all (``plain``) and whether it is a probe."""
        lookup_counts = as_array(lookup_counts)
        batch = self.batch = lookup_counts.shape[0]
        self.probing = self.plain = self.guard_probe = self.cost_probe = self.race_plain = False
        exploring = self._exploring(batch)
        if exploring is not None:
            self.plain = not exploring
            return exploring
        if self.race.plain_now(bucket(batch)):  # a plain window measuring, or drafting lost by the clock
            self.plain = self.race_plain = True
            self.counters.race_plain_steps += 1
            return False
        draft_pays = self._asking_pays(batch, lookup_counts)
        if self.guard.backing_off:
            # plain steps; every `guard_interval` of them (doubling while probes lose) one verifies the estimates'
            # plan, and the guard judges it
            self.since_guard_probe += 1
            if draft_pays and self.since_guard_probe >= self.guard_interval:
                self.guard_interval = min(2 * self.guard_interval, MAX_GUARD_INTERVAL)
                self.since_guard_probe = 0
                self.guard_probe = True
                return True
            self.plain = True
        elif draft_pays:
            self.guard_interval = FIRST_GUARD_INTERVAL
            self.cost_probe_interval = FIRST_COST_PROBE_INTERVAL
            if self.costs(batch).fresh(batch):
                return True
            # a plain step when none ran lately, however well drafting does: what a plain step costs at this batch
            # size is what every choice and the guard weigh drafting against, and only plain steps measure it
            self.plain = True
            return False
        self.since_probe += 1
        self.since_cost_probe += 1
        if self.since_probe < PROBE_INTERVAL or not self._may_probe():
            return False
        self.probing, self.since_probe = True, 0  # T1 runs for the ledger, unverified unless it pays
        self.counters.probes += 1
        stale = self.costs(batch).widest_fresh() <= batch + 1  # no wide step measured lately
        if not self.plain and stale and self.since_cost_probe >= self.cost_probe_interval:
            # ... and once in a while one request verifies everything drafted: the curve's wide steps are measured
            # again (a cost that fell while nothing wide ran would otherwise never be seen)
            self.cost_probe, self.since_cost_probe = True, 0
            self.cost_probe_interval = min(2 * self.cost_probe_interval, MAX_COST_PROBE_INTERVAL)
        return True

    def wants_block(self, t1_conf: Any, lookup_counts: Any) -> bool:
        """With T1's confidence ``[B]`` known: is the block's forward worth running? (When it is not, it runs anyway
        now and then for the ledger, within the probes' share of the time: its positions keep being judged.)"""
        self.block_probe = False
        if self._exploring(t1_conf.shape[0]) is not None or self.cost_probe:
            return True
        t1_conf, lookup_counts = as_array(t1_conf)[:, None], as_array(lookup_counts)
        full = self._gains(t1_conf.shape[0], t1_conf, lookup_counts, drafted=None)
        t1_only = self._gains(t1_conf.shape[0], t1_conf, lookup_counts, drafted=1)
        if self._best(full, self._block).rate > self._best(t1_only, 0.0).rate:
            self.since_block = 0
            return True
        self.since_block += 1
        if self.since_block < PROBE_INTERVAL or not self._may_probe():
            return False
        self.block_probe, self.since_block = True, 0
        self.counters.probes += 1
        return True

    def choose(self, request_ids: list[str], draft_conf: Any, lookup_counts: Any) -> StepPlan:
        """The step's plan, given the draft's confidences ``[B, d]`` (``None``: the draft was not asked) and each
        request's prompt-lookup proposals ``[B]`` (tensors or arrays); remembered for `learn`."""
        lookup_counts = as_array(lookup_counts)
        draft_conf = None if draft_conf is None else as_array(draft_conf)
        batch = self.batch = lookup_counts.shape[0]
        if draft_conf is not None:
            self.t1_confidences.extend(draft_conf[:, 0].tolist())
        rows = np.arange(batch)
        drafted = 0 if draft_conf is None else draft_conf.shape[1]
        all_gains = self._gains(batch, draft_conf, lookup_counts, drafted=drafted)
        exploring = self._exploring(batch)
        if self.plain or exploring is False:  # (self.plain: the guard backs off, or a plain step that measures)
            source, widths = np.full(batch, DRAFT), np.zeros(batch, dtype=np.int64)
        elif exploring:  # one proposal per request: the curve's first step past plain (module docstring)
            source = np.full(batch, DRAFT if drafted else LOOKUP)
            widths = np.minimum((all_gains[source, rows] > -np.inf).sum(-1), 1)
        else:
            curve = self._curve(batch)
            source = choose_sources(all_gains, curve)
            widths = allocate(all_gains[source, rows], curve).widths
            if self.cost_probe and drafted and not widths.any():
                source[0], widths[0] = DRAFT, drafted  # one request verifies all it was proposed
        self.judged = exploring is None and (self.guard_probe or not self.guard.backing_off)
        plan = StepPlan(source.astype(np.int64), widths.astype(np.int64))
        self.counters.add(plan)
        self.counters.drafted_steps += drafted > 0
        self._remember(request_ids, plan, draft_conf)
        return plan

    def padded_conf(self, conf: Any) -> np.ndarray:
        """``[B, K]`` confidences of ``[B, d]`` drafted proposals (zero past them): rows of different steps stack."""
        conf = as_array(conf)
        out = np.zeros((conf.shape[0], self.num_candidates))
        out[:, : conf.shape[1]] = conf
        return out

    # -- the estimates --------------------------------------------------------------------------------------------

    def costs(self, batch: int) -> StepCosts:
        """The step cost curve of ``batch``'s bucket."""
        return self.bucket_costs.setdefault(bucket(batch), StepCosts())

    @property
    def _block(self) -> float:
        """Seconds of the draft's block at this batch size (0 before it ran: optimistic, so it runs and is
        measured)."""
        return self.bucket_stages.get(bucket(self.batch), {}).get("block", 0.0)

    @property
    def _t1(self) -> float:
        """Seconds of the head's T1 (its LM head over the batch)."""
        return self.bucket_stages.get(bucket(self.batch), {}).get("t1", 0.0)

    def _may_probe(self) -> bool:
        """Probes (the draft run for the ledger alone) may cost at most `EXPLORATION` of the time."""
        return self.spent["probes"] <= EXPLORATION * self.spent["total"]

    def _asking_pays(self, batch: int, lookup_counts: np.ndarray) -> bool:
        """Whether asking the draft for T1 is expected to pay, counting what T1's confidence will be worth: asked,
        the draft's confidence decides each request's width, so the value of asking is the mean, over the T1
        confidences recent steps saw (a few quantiles), of the best plan given that confidence (T1 alone, or the
        whole block at its cost), each charged T1's seconds, against the plan without the draft."""
        key = (batch, int((lookup_counts > 0).sum()))
        cached = self._asked.get(key)
        if cached is not None and self.counters.steps - cached[1] < ASK_REFRESH:
            return cached[0]
        without = self._gains(batch, None, lookup_counts, drafted=0)
        baseline = self._best(without, 0.0).rate
        levels = np.quantile(self.t1_confidences, T1_QUANTILES).tolist() if self.t1_confidences else [None]
        tokens = seconds = 0.0
        for level in levels:
            conf = None if level is None else np.full((batch, 1), level)
            plans = [
                self._best(self._gains(batch, conf, lookup_counts, drafted=None), self._t1 + self._block),
                self._best(self._gains(batch, conf, lookup_counts, drafted=1), self._t1),
            ]
            best = max(plans, key=lambda plan: plan.rate)
            tokens, seconds = tokens + best.tokens, seconds + best.seconds
        pays = tokens / seconds > baseline
        self._asked[key] = (pays, self.counters.steps)
        return pays

    def _exploring(self, batch: int) -> bool | None:
        """The first steps measure the curve: ``False`` a plain step (nothing seen yet), ``True`` a step verifying
        one proposal per request (nothing wider than this batch's plain step seen); ``None`` once both are known."""
        points = self.costs(batch).points
        if not points:
            return False
        if max(points) <= batch:
            return True
        return None

    def _curve(self, batch: int) -> np.ndarray:
        return self.costs(batch).curve(batch * (self.num_candidates + 1))

    def _best(self, all_gains: np.ndarray, drafted_seconds: float) -> Plan:
        """The plan over the best source per proposal (an optimistic bound of the step's rate)."""
        return allocate(all_gains.max(axis=0), self._curve(all_gains.shape[1]), drafted_seconds)

    def _gains(self, batch: int, draft_conf: Any, lookup_counts: np.ndarray, drafted: int | None) -> np.ndarray:
        """``[2, B, K]`` gains of the draft's proposals (confidences where known, priors beyond) and of each request's
        prompt-lookup proposals; ``-inf`` past the ``drafted`` draft proposals (``None``: not drafted yet, the
        priors stand for them) and past each request's lookup proposals."""
        positions = np.arange(self.num_candidates)[None]
        draft = np.cumprod(self.draft.rates(draft_conf, batch, self.calibration), axis=1)
        if drafted is not None:
            draft = np.where(positions < drafted, draft, -np.inf)
        if self.lookup is None:
            lookup = np.full((batch, self.num_candidates), -np.inf)
        else:
            lookup = np.cumprod(self.lookup.rates(None, batch), axis=1)
            lookup = np.where(positions < lookup_counts[:, None], lookup, -np.inf)
        return np.stack([draft, lookup])

    def _remember(self, request_ids: list[str], plan: StepPlan, draft_conf: np.ndarray | None) -> None:
        self.planned = dict(zip(request_ids, plan.widths.tolist(), strict=True))
        padded = None if draft_conf is None else self.padded_conf(draft_conf)
        for row, request in enumerate(request_ids):
            if int(plan.widths[row]):
                source = int(plan.source[row])
                self.pending[request] = (source, padded[row] if source == DRAFT and padded is not None else None)
