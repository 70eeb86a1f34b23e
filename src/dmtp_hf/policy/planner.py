"""Which proposals a round verifies, given what each is expected to commit and what a step over T tokens costs.

Every engine step verifies, for each request b, ``w_b`` proposals (``w_b = 0``: a plain decoding step for that
request) in one target forward over ``T = sum_b (1 + w_b)`` tokens. Its expected yield is
``sum_b (1 + sum_{j < w_b} g[b, j])`` tokens, where ``g[b, j]`` is the probability that request b's proposal j is
accepted (`acceptance.gains`), non-increasing in j. The plan maximises tokens per second.

`allocate` does it exactly for any step cost that depends on T only: for a fixed T, the best yield takes the
``T - B`` largest gains of the whole batch, and because a row's gains never increase, the largest gains of a row are
its first ones: a width per row. Sorting the batch's gains once and scanning every T gives the optimum (one sort and
one cumulative sum, no loop over rows). A row whose proposals are fewer than K has ``-inf`` gains past them.

`choose_sources` picks, per row, which of several proposals (the draft's block, prompt lookup) to verify: the one
whose gains above the plan's marginal gain add up to more. `best_uniform_width` is the same question when every row
of a padded batch verifies one shared width (``generate``'s batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Plan", "allocate", "best_uniform_width", "choose_sources"]


@dataclass
class Plan:
    """A step's widths and what the model expects of it."""

    widths: torch.Tensor  # [B] proposals each row verifies
    tokens: float  # expected tokens committed over the batch
    seconds: float  # expected seconds of the step

    @property
    def rate(self) -> float:
        """Expected tokens per second."""
        return self.tokens / self.seconds

    @property
    def verified(self) -> int:
        """Proposals verified over the batch (T - B)."""
        return int(self.widths.sum())


def allocate(gains: torch.Tensor, step_seconds: torch.Tensor, drafted_seconds: float = 0.0) -> Plan:
    """The widths that maximise expected tokens per second.

    ``gains`` ``[B, K]``: probability that each row's proposal j is accepted (non-increasing along j; ``-inf`` where
    a row has no proposal). ``step_seconds`` ``[T_max + 1]``: seconds of a step over T tokens (T >= B; entries past
    its end cost as its last). ``drafted_seconds``: what a step pays besides when any proposal is verified.
    """
    batch, k = gains.shape
    flat = gains.float().flatten().cpu()
    order = torch.sort(flat, descending=True, stable=True).indices  # stable: a row's gains stay in order
    cumulative = torch.cat([torch.zeros(1), flat[order].cumsum(0)])  # [B*K + 1]: yield of the m best proposals
    tokens = batch + cumulative
    totals = (batch + torch.arange(batch * k + 1)).clamp(max=step_seconds.numel() - 1)
    seconds = step_seconds.float().cpu()[totals]
    seconds[1:] += drafted_seconds
    rate = torch.where(torch.isfinite(tokens), tokens / seconds, torch.full_like(tokens, -1.0))
    best = int(rate.argmax())  # the first of equals: fewer proposals where more buy nothing
    rows = torch.div(order[:best], k, rounding_mode="floor")
    widths = torch.bincount(rows, minlength=batch)
    return Plan(widths, float(tokens[best]), float(seconds[best]))


def best_uniform_width(gains: torch.Tensor, width_seconds: list[float]) -> int:
    """The one width (0..K) for every row with the most expected tokens per second; ``width_seconds[k]``: seconds of
    a round that verifies k proposals in every row."""
    batch = gains.shape[0]
    cumulative = torch.cat([torch.zeros(batch, 1), gains.float().cpu().clamp(min=0).cumsum(dim=1)], dim=1)
    totals = (1 + cumulative).sum(dim=0)  # [K + 1] tokens for the batch at each width
    widths = range(len(width_seconds))
    return max(widths, key=lambda w: float(totals[w]) / width_seconds[w])


def choose_sources(gains: torch.Tensor, step_seconds: torch.Tensor, drafted_seconds: float = 0.0) -> torch.Tensor:
    """``[B]`` index of the source (axis 0 of ``gains`` ``[S, B, K]``) each row verifies.

    The marginal gain a proposal must reach to be worth its verify is read off the plan over the best of every
    source (per row and position: an optimistic bound); a row takes the source whose gains above that threshold sum
    to the most (ties: the first source)."""
    envelope = gains.max(dim=0).values  # [B, K]
    plan = allocate(envelope, step_seconds, drafted_seconds)
    chosen = torch.arange(envelope.shape[1])[None] < plan.widths[:, None]
    selected = envelope[chosen]
    threshold = float(selected.min()) if selected.numel() else float(envelope.max().clamp(min=0))
    value = (gains.float() - threshold).clamp(min=0).nan_to_num(0.0).sum(dim=-1)  # [S, B]
    return value.argmax(dim=0)
