"""How many candidates to verify each round: predicted acceptance against the measured cost of the round.

A round that verifies k candidates commits ``1 + sum_{j <= k} P(L >= j)`` tokens in expectation and costs the
drafter's stages plus a target forward over ``k + 1`` tokens. ``verify_length="auto"`` picks, per round, the k that
maximises tokens per second over the batch (``k = 0`` is a plain decoding step):

- `Calibration`: ``P(candidate j accepted | the ones before were)`` from the draft's own confidence (the
  probability it gave its candidate), a monotone map per position fitted on recorded ``(confidence, accepted)``
  pairs (``dmtp calibrate``) and stored in the draft's config; uncalibrated (MTP-k heads), the confidence
  rescaled per position to what the rounds accept on average (`AutoWidth.acceptance`).
- `CostModel`: the target forward's seconds per width, first from a short timing of dummy forwards on this machine
  (cached per target, device, dtype and batch size; never a constant), then from what the generation's own verify
  stages cost, round by round (a busy machine shifts the choice within a few rounds; what rounds taught is kept
  for the next call); the drafter's stages as the generation measures them; and what every round pays besides
  (its bookkeeping, the rollback), measured apart for drafted and plain rounds: a cost
  per round, whatever its width, which only wider rounds spread over more tokens.
- `AutoWidth`: the choice. Before drafting, from what earlier rounds accepted per position (before any evidence the
  calibration's held-out rates, or optimistic without them; kept across calls for the same draft): when no width
  pays, the round is a plain step that runs no drafter stage, and a probe that verifies the whole block follows
  after 2, 4, ... such rounds (doubling while probes lose, at most ~`EXPLORATION` of the time, the schedule kept
  across calls). DMTP asks again after T1, before running DFlash: when T1 alone (or nothing) is the best bet, the
  DFlash forward is skipped; MTP-k chains stop when the next step does not pay for itself.
- `~dmtp_policy.guard.GuardRail`: no estimate is trusted blindly. What the drafted rounds of a recent window really
  committed per second is compared with plain steps; when drafting has lost, the policy decodes plainly and only
  its probes draft, until one beats plain steps again.
- One width serves the whole batch: a batch's verify is one padded rectangle, so a shorter block for one row would
  save no compute and only give up tokens.

Every policy answers the drafter's questions of a round (`RoundWidth`): does this round draft at all
(`~RoundWidth.begin_round`), is drafting past the first d candidates worth its next stage
(`~RoundWidth.draft_further`), how many of the drafted candidates are verified (`~RoundWidth.choose`); after the
verify it hears what was accepted (`~RoundWidth.learn`) and, through the statistics' timer, what each stage cost
(`~RoundWidth.timed`). `AllCandidates` (the default) and `FixedWidth` answer from K and ``verify_length`` alone.

Lossless is unchanged: a shorter block is verified exactly as a long one. Choosing reads the confidences on the
host: one more synchronisation per round in ``auto`` mode.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from dmtp_policy.acceptance import AcceptanceEstimate, Calibration, isotonic
from dmtp_policy.guard import GuardRail
from dmtp_policy.planner import best_uniform_width
from dmtp_policy.requests import LOOKUP_PRIOR

from .target.linear_attention import has_gated_delta_net, verify_kernel_kwargs

__all__ = [
    "AllCandidates",
    "AutoWidth",
    "Calibration",
    "CostModel",
    "FixedWidth",
    "RoundWidth",
    "check_verify_length",
    "confidences",
    "width_policy",
]

_COSTS: dict[tuple, dict[int, float]] = {}  # (target id, device, dtype, batch) -> width -> seconds
_LEARNED: dict[tuple, dict] = {}  # the same key -> what rounds taught `CostModel` (carried to the next call)
# What earlier calls learned of a draft's acceptance per position (`AutoWidth.prior`, ...): per draft
# (or MTP head) module, then per strategy and K.
_PRIORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> {(name, K): (prior, seen, confidence)}
# Before any evidence a candidate is assumed accepted this often (a calibrated draft: its calibration's held-out
# rate), worth this many observations: optimistic, so a new draft is tried before it is judged. Later evidence moves
# the estimate with weight >= PRIOR_RATE.
PRIOR_ACCEPTANCE = 0.9
PRIOR_WEIGHT = 2.0
PRIOR_RATE = 0.1
# Plain rounds between probes of a draft that does not pay (`AutoWidth.drafts`): the first wait, and the longest
# the doubling reaches unless a probe costs so much that EXPLORATION (the share of the time probes may lose against
# plain decoding) asks for a longer one.
FIRST_PROBE_INTERVAL = 2
MAX_PROBE_INTERVAL = 32
EXPLORATION = 0.02
# Drafted rounds that verify fewer than K candidates between two that verify the whole block (`AutoWidth.drafts`),
# at least: positions past the chosen width are otherwise never tested again, and one unlucky estimate would stay
# wrong. Longer where such a probe would cost more than EXPLORATION of the time.
DEEP_PROBE_INTERVAL = 8
# How fast measured round costs move the estimates (`CostModel.observe_verify`): the load and a width's own
# observations; and how fast what was seen of a width not run lately fades (a width found dear on a busy machine
# is not written off for good; deep probes see it again).
LEARNING_RATE = 0.3
DRIFT_RATE = 0.02
# What a round pays besides its verify and its drafter stages, once per round whatever its width (`CostModel.overhead`):
# the round's bookkeeping and the rollback of what was rejected. Left out, it would make narrow widths look cheaper
# than they are: more rounds, each paying it. (The MTP head catching up on committed pairs is paid per token, and
# plain rounds only defer it to the next drafted one: charged to that round it would price drafting by the length
# of the plain streak before it.)
ROUND_OVERHEAD = frozenset({"commit", "rollback"})


def confidences(tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` the probability the draft gave each of its candidates (``scores`` ``[B, k, V]``, processed)."""
    return scores.float().softmax(dim=-1).gather(-1, tokens[..., None])[..., 0]


class RoundWidth:
    """The width policy a drafter asks each round (see the module docstring): every candidate it drafts, here.

    ``stage_plan[k]`` names the drafter stages a round verifying k candidates runs (statistics stage names, e.g.
    DMTP ``[[], ["t1"], ["t1", "dflash"], ...]``); the drafter gives it when the policy is made (`width_policy`).
    """

    def __init__(self, max_candidates: int, stage_plan: list[list[str]] | None = None) -> None:
        self.max_candidates = max_candidates
        self.stage_plan = stage_plan or [[]] * (max_candidates + 1)
        self.widths: list[int] = []  # the chosen width of every round
        self.skipped = 0  # rounds that ran no draft forward beyond T1 (or none at all)
        self.plain = 0  # of which rounds that ran no drafter stage at all

    def begin_round(self, batch_size: int) -> bool:
        """Before any drafter stage: does this round draft? (``False``: a plain decoding step.)"""
        return True

    def draft_further(self, tokens: torch.Tensor, scores: torch.Tensor) -> bool:
        """With the first d candidates drafted (``tokens`` ``[B, d]``, processed ``scores`` ``[B, d, V]``): is the
        drafter's next stage worth running?"""
        return tokens.shape[1] < self.max_candidates

    def choose(self, tokens: torch.Tensor, scores: torch.Tensor) -> int:
        """How many of the drafted candidates (``tokens`` ``[B, d]``) this round verifies."""
        return tokens.shape[1]

    def learn(self, num_valid: list[int] | None) -> None:
        """After the verify: each row's committed count (accepted + bonus)."""

    def timed(self, stage: str, seconds: float) -> None:
        """A stage's measured seconds, from the statistics' timer."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Finished rows left the batch."""


class AllCandidates(RoundWidth):
    """Every round drafts and verifies all K candidates (``verify_length=None``)."""


class FixedWidth(RoundWidth):
    """Every round drafts and verifies ``width`` candidates (``verify_length=N``, at most K; 0: plain decoding)."""

    def __init__(self, width: int, max_candidates: int, stage_plan: list[list[str]] | None = None) -> None:
        super().__init__(max_candidates, stage_plan)
        self.width = min(width, max_candidates)

    def begin_round(self, batch_size: int) -> bool:
        """Width 0 never drafts."""
        return self.width > 0

    def draft_further(self, tokens: torch.Tensor, scores: torch.Tensor) -> bool:
        """Until ``width`` candidates are drafted."""
        return tokens.shape[1] < self.width

    def choose(self, tokens: torch.Tensor, scores: torch.Tensor) -> int:
        """``width``, or fewer when the drafter proposed fewer."""
        return min(self.width, tokens.shape[1])


class CostModel:
    """Seconds of a round's parts: the target forward per width and the drafter's stages.

    The forward's seconds start from a one-off timing (``verify``: tokens in the forward -> seconds, measured once
    per target/device/dtype/batch, or given) and then follow what the generation's own verify stages cost
    (`observe_verify`): the ratio of observed to timed cost over all recent rounds (``load``) scales every width,
    and each width keeps how much dearer or cheaper than that it ran (fading slowly while it is not run), so a
    change of machine load moves every estimate within a few rounds and a width that has become dearer than the
    others is priced as such. Drafter stages are running
    means of what the generation measured (`update`). Nothing here reads a clock: the statistics' timer feeds it,
    so tests drive it with synthetic seconds. ``follow_rounds=False`` keeps the verify costs as given (a caller's
    own cost table, trusted as it is).
    """

    def __init__(self, verify: dict[int, float], follow_rounds: bool = True, learned: dict | None = None) -> None:
        self.follow_rounds = follow_rounds
        self.timed = dict(verify)  # the one-off timing
        self.stages: dict[str, float] = {}
        # per round, whatever its width (`ROUND_OVERHEAD`): running means for drafted and for plain rounds
        self.overhead: dict[str, float] = {}
        # observed / timed over recent rounds of every width ("load"), and per width its observed / timed relative
        # to the load ("ratios": tokens in the forward -> ratio; 1 = as timed, scaled with the machine); `measure`
        # shares them with later calls for the same target and batch size
        self.learned = learned if learned is not None else {}
        self.learned.setdefault("load", 1.0)
        self.learned.setdefault("ratios", {})
        self._estimate()  # the current estimates, `verify`: tokens in the forward -> seconds

    @property
    def load(self) -> float:
        """Observed / timed verify seconds over recent rounds of every width."""
        return self.learned["load"]

    @load.setter
    def load(self, value: float) -> None:
        self.learned["load"] = value

    @property
    def ratios(self) -> dict[int, float]:
        """Per width that has run: its observed / timed verify seconds relative to the load's."""
        return self.learned["ratios"]

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A verify stage over ``tokens`` positions took ``seconds``: update the load and that width's cost relative
        to it; every estimate is its timing x the load x its relative cost."""
        if not self.follow_rounds:
            return
        tokens = min(tokens, max(self.timed))
        ratio = seconds / self.timed[tokens]
        self.load += LEARNING_RATE * (ratio - self.load)
        for width in self.timed:
            if width == tokens:
                previous = self.ratios.get(width)
                relative = ratio / self.load
                self.ratios[width] = relative if previous is None else previous + LEARNING_RATE * (relative - previous)
            elif width in self.ratios:  # not run this round: what was seen of it fades, slowly, into the load's
                self.ratios[width] += DRIFT_RATE * (1.0 - self.ratios[width])
        self._estimate()

    def _estimate(self) -> None:
        self.verify = {width: t * self.load * self.ratios.get(width, 1.0) for width, t in self.timed.items()}

    @classmethod
    def measure(
        cls,
        target,
        batch_size: int,
        max_width: int,
        repeats: int = 3,
        context: int = 64,
        on_width: Callable[[int], None] | None = None,
    ) -> CostModel:
        """Time target forwards of 1..``max_width`` tokens after a ``context``-token prompt (best of ``repeats``,
        made non-decreasing in the width; cached). ``on_width(width)`` is called after each width is timed (a
        progress bar: this takes minutes on a large target); never for cached widths."""
        embedding = target.get_input_embeddings().weight
        key = (id(target), embedding.device, embedding.dtype, batch_size)
        if key not in _COSTS or max(_COSTS[key]) < max_width:  # a wider drafter than the last one needs more
            _COSTS[key] = _time_widths(target, batch_size, max_width, repeats, context, on_width)
            _LEARNED.pop(key, None)
        return cls(dict(_COSTS[key]), learned=_LEARNED.setdefault(key, {}))

    def update(self, stage: str, seconds: float) -> None:
        """Fold one measurement of a drafter stage into its running mean."""
        previous = self.stages.get(stage)
        self.stages[stage] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def update_overhead(self, drafted: bool, seconds: float) -> None:
        """Fold what one round paid besides its verify and drafter stages into the running mean of its kind."""
        kind = "drafted" if drafted else "plain"
        previous = self.overhead.get(kind)
        self.overhead[kind] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def round_seconds(self, width: int, draft_stages: list[str]) -> float:
        """A round verifying ``width`` candidates after running ``draft_stages`` (none: a plain step), with what
        every round of its kind pays besides."""
        if draft_stages:
            overhead = self.overhead.get("drafted", 0.0)
        else:  # before any plain round is measured, a plain step pays at least the bookkeeping every round pays
            overhead = self.overhead.get("plain", self.stages.get("commit", 0.0))
        stages = sum(self.stages.get(s, 0.0) for s in draft_stages)
        return self.verify[min(width + 1, max(self.verify))] + stages + overhead


@torch.no_grad()
def _time_widths(
    target, batch_size: int, max_width: int, repeats: int, context: int, on_width: Callable[[int], None] | None = None
) -> dict[int, float]:
    device = target.get_input_embeddings().weight.device
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch_size, context), generator=generator).to(device)
    has_linear_attention = has_gated_delta_net(target)
    timings = {}
    for width in range(1, max_width + 1):
        ids = prompt[:, :width]
        samples = []
        for _ in range(repeats + 1):  # the first call warms up this shape
            fresh = DynamicCache(config=target.config)  # every timing from the same cached length
            target(input_ids=prompt, cache=fresh, use_cache=True, logits_to_keep=1)
            _sync(device)
            start = time.perf_counter()
            target(input_ids=ids, cache=fresh, use_cache=True, **verify_kernel_kwargs(has_linear_attention, width))
            _sync(device)
            samples.append(time.perf_counter() - start)
        timings[width] = min(samples[1:])  # the least disturbed run (a shared machine only ever adds time)
        if on_width is not None:
            on_width(width)
    # a wider forward never costs less: noise that says otherwise is pooled away (isotonic, non-decreasing)
    pooled = isotonic(list(timings.values()), [1] * len(timings))
    return dict(zip(timings, pooled, strict=True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def width_policy(verify_length: int | str | RoundWidth | None, target, drafter, batch_size: int) -> RoundWidth:
    """The round width policy for ``verify_length``: `AllCandidates` (``None``), `FixedWidth` (a number, at most
    K) or `AutoWidth` (``"auto"``, with the target's costs measured here and the draft's calibration; or an
    `AutoWidth` the caller built). The drafter's ``stage_plan`` says what each width's round runs."""
    num_candidates = drafter.num_candidates
    stage_plan = drafter.stage_plan()
    if verify_length is None:
        return AllCandidates(num_candidates, stage_plan)
    if isinstance(verify_length, AutoWidth):  # a policy built by the caller (its own costs or calibration)
        verify_length.stage_plan = stage_plan
        verify_length.pending = None
        verify_length.widths = []
        verify_length.skipped = 0
        verify_length.plain = 0
        return verify_length
    if verify_length == "auto":
        draft = getattr(drafter, "draft", None)
        stored = draft.config.dmtp_config.get("acceptance_calibration") if draft is not None else None
        cost = CostModel.measure(target, batch_size, num_candidates + 1)
        policy = AutoWidth(cost, Calibration.from_dict(stored), num_candidates, stage_plan)
        source = draft if draft is not None else getattr(drafter, "head", drafter)
        key = (getattr(drafter, "name", type(drafter).__name__), num_candidates)
        # across calls: the estimates (lists, shared), the probe schedule (`AutoWidth.memory`) and the guard rail
        learned = _PRIORS.setdefault(source, {})
        fresh = {
            "prior": policy.prior,
            "seen": policy.seen,
            "mean_confidence": policy.mean_confidence,
            "probe_interval": policy.probe_interval,
            "since_probe": 0,
            "guard": policy.guard,  # a back-off outlives the call: the next one does not relearn it
            "lookup_estimate": policy.lookup_estimate,
        }
        policy.memory = learned.setdefault(key, fresh)
        for name, value in policy.memory.items():
            setattr(policy, name, value)
        return policy
    check_verify_length(verify_length)
    return FixedWidth(verify_length, num_candidates, stage_plan)


def check_verify_length(verify_length) -> None:
    """Refuse a ``verify_length`` that is not ``None``, ``"auto"``, an `AutoWidth` or an integer >= 0."""
    if verify_length is None or verify_length == "auto" or isinstance(verify_length, AutoWidth):
        return
    if isinstance(verify_length, bool) or not isinstance(verify_length, int) or verify_length < 0:
        raise ValueError(f"verify_length must be 'auto', an AutoWidth or an integer >= 0, got {verify_length!r}")


class AutoWidth(RoundWidth):
    """Chooses the number of candidates of a round (see the module docstring)."""

    def __init__(
        self,
        cost: CostModel,
        calibration: Calibration,
        max_candidates: int,
        stage_plan: list[list[str]] | None = None,
    ) -> None:
        super().__init__(max_candidates, stage_plan)
        self.cost = cost
        self.calibration = calibration
        # P(accepted | earlier accepted) per position, learned; before any round the calibration's held-out rates,
        # or optimistic for a draft without them
        base = calibration.base_rates
        self.prior = [base[min(j, len(base) - 1)] if base else PRIOR_ACCEPTANCE for j in range(max_candidates)]
        self.seen = [0.0] * max_candidates  # tests each prior has absorbed
        self.mean_confidence = [PRIOR_ACCEPTANCE] * max_candidates  # of the tested candidates (see `acceptance`)
        self.probing = False  # this round verifies the whole block, whatever the estimates (see `drafts`)
        # the last round's verified confidences [B, k] and predicted acceptance of all drafted candidates [B, d],
        # until its verdict is learned
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending_rows: torch.Tensor | None = None  # [B] the rows `pending` holds, where lookup took others
        self.lookup_estimate = AcceptanceEstimate(max_candidates, [LOOKUP_PRIOR])  # prompt lookup's, per position
        self.lookup_rows = 0  # rows of rounds that verified prompt lookup instead of the draft
        self.probe_interval = FIRST_PROBE_INTERVAL  # plain rounds between probes (`drafts`)
        self.since_probe = 0  # plain rounds since the last probe
        self.since_full_block = 0  # drafted rounds since the last that verified all K candidates
        self.memory: dict[str, Any] | None = None  # what later calls for the same draft start from (`width_policy`)
        self.guard = GuardRail()  # what drafted rounds really commit per second, against plain steps
        # the open round: whether it drafts, and what it has paid so far of `ROUND_OVERHEAD` (None: no round yet)
        self.round_drafts: bool | None = None
        self.round_overhead = 0.0

    # -- the round's questions (`RoundWidth`) -------------------------------------------------------------------

    def begin_round(self, batch_size: int) -> bool:
        """`drafts` over the drafter's stage plan (a call can end between a proposal and its verdict: a new
        round forgets an unanswered one)."""
        self.pending = None
        self.guard.begin_round(batch_size, lambda _: self.cost.round_seconds(0, []))
        if self.round_drafts is not None and self.round_overhead > 0:
            self.cost.update_overhead(self.round_drafts, self.round_overhead)
        self.round_overhead = 0.0
        self.round_drafts = self.drafts(batch_size, self.stage_plan)
        return self.round_drafts

    def draft_further(self, tokens: torch.Tensor, scores: torch.Tensor) -> bool:
        """Only while the best width, given these candidates' predicted acceptance, is wider than what is drafted
        (DMTP: after T1, whether DFlash runs; MTP-k: whether the chain goes on)."""
        drafted = tokens.shape[1]
        further = self.best(self.acceptance(confidences(tokens, scores)), self.stage_plan, drafted) > drafted
        self.skipped += drafted == 1 and not further
        return further

    def choose(self, tokens: torch.Tensor, scores: torch.Tensor) -> int:
        """The best width given every drafted candidate's predicted acceptance (remembered for `learn`)."""
        conf = confidences(tokens, scores)
        predicted = self.acceptance(conf)
        width = min(self.best(predicted, self.stage_plan, tokens.shape[1]), tokens.shape[1])
        self.pending = (conf[:, :width], predicted)
        self.widths.append(width)
        self.since_full_block = 0 if width == self.max_candidates else self.since_full_block + 1
        return width

    def learn(self, num_valid: list[int] | None) -> None:
        """The round's acceptance (committed counts - 1 per row) updates the priors (of the rows that verified the
        draft's candidates, where prompt lookup took some: `restrict_to_draft`)."""
        if self.pending is not None and num_valid is not None:
            conf, predicted = self.pending
            if self.pending_rows is not None:
                num_valid = [n for n, keep in zip(num_valid, self.pending_rows.tolist(), strict=True) if keep]
            accepted = torch.tensor([max(count - 1, 0) for count in num_valid], device=conf.device)
            if accepted.numel():
                self.observe(conf, accepted, predicted)
        self.pending_rows = None
        if num_valid is not None and self.widths:
            self.guard.committed(self.widths[-1], sum(num_valid))
        self.pending = None

    def timed(self, stage: str, seconds: float) -> None:
        """What the rounds really cost feeds the cost model: drafter stages, and the verify of the width just chosen
        (a plain round's is one token); the guard rail hears every stage of the round."""
        self.guard.stage(stage, seconds)
        if stage in ROUND_OVERHEAD:
            self.round_overhead += seconds
        if stage == "commit":
            self.cost.update(stage, seconds)
        if stage == "verify" and self.widths:
            self.cost.observe_verify(self.widths[-1] + 1, seconds)
        elif any(stage in stages for stages in self.stage_plan):
            self.cost.update(stage, seconds)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the unanswered round's rows."""
        if self.pending is not None:
            if self.pending_rows is not None:  # pending holds the draft rows only: keep those of `rows`
                kept = torch.zeros_like(self.pending_rows)
                kept[rows] = True
                self.pending = (self.pending[0][kept[self.pending_rows]], self.pending[1][kept[self.pending_rows]])
                self.pending_rows = self.pending_rows[rows]
            else:
                self.pending = (self.pending[0][rows], self.pending[1][rows])

    # -- prompt lookup's rows (`lookup.LookupRounds`) -----------------------------------------------------------

    def drafted_gains(self, batch_size: int, kept: int) -> torch.Tensor:
        """``[B, K]`` probability that each of this round's kept draft candidates is accepted (``-inf`` past the
        ``kept`` ones, and everywhere in a round that drafted nothing)."""
        out = torch.full((batch_size, self.max_candidates), float("-inf"))
        if self.pending is not None and kept:
            out[:, :kept] = self.pending[1][:, :kept].float().cpu().cumprod(dim=1)
        return out

    def width_seconds(self) -> list[float]:
        """Seconds of this round at each width 0..K, its drafter stages paid already (what prompt lookup's rows
        add is verify time)."""
        drafted = 0 if self.pending is None else self.pending[1].shape[1]
        paid = self.stage_plan[drafted]
        return [self.cost.round_seconds(k, paid) for k in range(self.max_candidates + 1)]

    def restrict_to_draft(self, draft_rows: torch.Tensor, width: int) -> None:
        """Prompt lookup took the other rows, and the round verifies ``width`` candidates: the draft learns from
        ``draft_rows`` ``[B]`` only (its confidences of what it drafted), the cost model and guard from ``width``."""
        self.lookup_rows += int((~draft_rows).sum())
        if self.pending is not None:
            rows = draft_rows.to(self.pending[0].device)
            self.pending = (self.pending[0][rows][:, :width], self.pending[1][rows])
            self.pending_rows = draft_rows
        if self.widths:
            self.widths[-1] = width

    # -- the estimates ---------------------------------------------------------------------------------------------

    def best(self, known: torch.Tensor, draft_stages: list[list[str]], drafted: int = 0) -> int:
        """The width (0..K) with the most expected tokens per second for the batch, given the acceptance
        probabilities ``known`` ``[B, j]`` of the first j candidates (priors beyond); ``draft_stages[k]`` are the
        drafter stages a width-k round runs. ``drafted`` candidates are drafted already: their stages are paid
        whatever width is verified (a narrower verify saves only verify time, it does not make the round plain)."""
        if self.probing:
            return self.max_candidates
        batch = known.shape[0]
        rates = torch.tensor(self.prior, dtype=torch.float32, device=known.device).expand(batch, -1).clone()
        rates[:, : known.shape[1]] = known.float()
        seconds = [self.cost.round_seconds(k, draft_stages[max(k, drafted)]) for k in range(self.max_candidates + 1)]
        return best_uniform_width(rates.cumprod(dim=1), seconds)

    def drafts(self, batch_size: int, draft_stages: list[list[str]]) -> bool:
        """Before any draft forward: does drafting pay this round, judged on the priors alone? When it does not,
        the round is a plain decoding step that runs no drafter stage at all (what a weak draft costs then is only
        keeping its state). Every ``probe_interval`` such rounds one drafts and verifies the whole block anyway, so
        the estimate of every position keeps following the text (and among narrower drafted rounds, one in
        `_deep_interval` verifies the whole block); the interval doubles while the probes keep losing,
        up to `MAX_PROBE_INTERVAL` or longer where a probe loses so much that probing would cost more than
        `EXPLORATION` of the time. The schedule carries over to the draft's next call. While the guard rail backs
        off, only its probes draft, at the width the estimates choose."""
        self.probing = False  # a new round
        best = self.best(torch.empty(batch_size, 0), draft_stages)
        if best > 0 and not self.guard.backing_off:
            self._schedule(FIRST_PROBE_INTERVAL, 0)
            self.probing = self.since_full_block >= self._deep_interval(best, draft_stages)
            return True
        if self.since_probe + 1 < self.probe_interval:
            self._schedule(self.probe_interval, self.since_probe + 1)
            self.widths.append(0)
            self.skipped += 1
            self.plain += 1
            return False
        self._schedule(min(2 * self.probe_interval, self._longest_interval(batch_size, draft_stages)), 0)
        # a probe of the estimates (no width pays) verifies the whole block, to test every position again; a probe
        # of the guard rail (the estimates say draft, the measured rounds said otherwise) drafts what they choose
        self.probing = best == 0
        return True

    def _expected_tokens(self, width: int) -> float:
        """Tokens a row commits in expectation verifying ``width`` candidates, by the priors."""
        return 1 + sum(itertools.accumulate(self.prior[:width], operator.mul))

    def _deep_interval(self, best: int, draft_stages: list[list[str]]) -> int:
        """Narrow drafted rounds between two that verify the whole block: at least `DEEP_PROBE_INTERVAL`, longer
        where the whole block's expected loss against the best width would cost more than `EXPLORATION` of the
        time (a wide verify dear on this machine, a DFlash forward that rarely pays)."""
        if best >= self.max_candidates:
            return DEEP_PROBE_INTERVAL
        best_round = self.cost.round_seconds(best, draft_stages[best])
        per_token = best_round / self._expected_tokens(best)
        full_round = self.cost.round_seconds(self.max_candidates, draft_stages[-1])
        loss = full_round - self._expected_tokens(self.max_candidates) * per_token
        return max(DEEP_PROBE_INTERVAL, math.ceil(loss / (EXPLORATION * best_round)))

    def _longest_interval(self, batch_size: int, draft_stages: list[list[str]]) -> int:
        """Plain rounds between probes at which a probe's expected loss (its round's time, less the plain steps that
        would commit its expected tokens) is `EXPLORATION` of the time; at least `MAX_PROBE_INTERVAL`."""
        step = self.cost.round_seconds(0, draft_stages[0])
        tokens = self._expected_tokens(self.max_candidates)  # per row, the whole block verified
        loss = self.cost.round_seconds(self.max_candidates, draft_stages[-1]) - tokens * step
        loss = max(loss, self.guard.probe_loss)  # what the last probe really lost, where the estimates miss it
        return max(MAX_PROBE_INTERVAL, math.ceil(loss / (EXPLORATION * step)))

    def _schedule(self, interval: int, since_probe: int) -> None:
        self.probe_interval = interval
        self.since_probe = since_probe
        if self.memory is not None:
            self.memory.update(probe_interval=interval, since_probe=since_probe)

    def observe(self, conf: torch.Tensor, accepted: torch.Tensor, predicted: torch.Tensor | None = None) -> None:
        """Update the priors with a round's acceptance (``conf`` ``[B, k]`` of the k verified candidates,
        ``accepted`` ``[B]`` counts). ``predicted`` ``[B, d]``: the acceptance predicted for all d >= k drafted
        candidates; with a calibration, those drafted but not verified count at their prediction, so a draft whose
        candidates are always cut away (width 0 after drafting) still teaches the priors that drafting does not
        pay."""
        batch, k = conf.shape
        steps = torch.arange(k, device=accepted.device)
        reached = steps[None] <= accepted[:, None]  # the candidate was tested (earlier ones accepted)
        passed = steps[None] < accepted[:, None]
        # only a calibration's prediction is evidence: an uncalibrated one is the prior rescaled, and folding it back
        # into the prior drifts it wherever the confidences of the cut candidates happen to sit
        calibrated = predicted is not None and bool(self.calibration.rates)
        cut = predicted[:, k:].float().mean(0) if calibrated else conf.new_zeros(0)
        tested = [reached.sum(0).float(), passed.sum(0).float(), (conf.float() * reached).sum(0)]
        values = torch.cat([*tested, cut]).tolist()  # one host sync
        counts = [values[i * k : (i + 1) * k] for i in range(3)]
        cut_means = values[3 * k :]
        for j, (tested_j, accepted_j, confidence) in enumerate(zip(*counts, strict=True)):
            if tested_j:
                self._update(j, tested_j, accepted_j, confidence)
        for j, value in enumerate(cut_means, start=k):
            self._update(j, batch, value * batch, None)

    def _update(self, j: int, tested: float, accepted: float, confidence: float | None) -> None:
        """A running mean at first (after PRIOR_WEIGHT pseudo-tests), then a moving average."""
        self.seen[j] += tested
        weight = max(tested / (self.seen[j] + PRIOR_WEIGHT), PRIOR_RATE)
        self.prior[j] += weight * (accepted / tested - self.prior[j])
        if confidence is not None:
            self.mean_confidence[j] += weight * (confidence / tested - self.mean_confidence[j])

    def acceptance(self, conf: torch.Tensor) -> torch.Tensor:
        """``[B, k]`` predicted acceptance of candidates with confidences ``conf``: the stored calibration, or for an
        uncalibrated draft its confidence rescaled per position so that on average it matches what the rounds
        accepted (``prior / mean confidence``)."""
        if self.calibration.rates:
            return self.calibration(conf)
        ratios = [p / max(c, 1e-3) for p, c in zip(self.prior, self.mean_confidence, strict=True)]
        scale = torch.tensor(ratios[: conf.shape[1]], dtype=torch.float32, device=conf.device)
        return (conf.float() * scale).clamp(0, 1)
