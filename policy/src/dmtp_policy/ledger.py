"""Proposals drafted but not verified, kept until the text shows whether they would have been accepted.

A proposal verified by the target teaches the acceptance estimates at once (the verify's accepted count). One that
was drafted and not verified (a request that took a plain step, prompt lookup instead of the draft, positions past
the chosen width) would otherwise teach nothing, and an estimate that only learns from what it chose to verify is
biased: after a bad streak it stops verifying and never sees the draft recover. But the text answers anyway: a
proposal for position p would have been accepted exactly when the token the target commits at p equals it (greedy;
when sampling, vLLM's rejection sampler accepts a greedy proposal x with probability p(x), and the committed token
equals x with that same probability, so the match is an unbiased sample of acceptance). So every drafted proposal is
judged, verified or not, once its positions are committed, at the cost of a comparison.

A `ProposalLedger` entry holds a request's drafted proposals from one step (their first position, the tokens, their
confidences) and ``first``: the index of the first one not verified (the verify judges those before it). When the
request's committed tokens cover them (or a mismatch is already visible), the entry resolves to its matched prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Judged", "ProposalLedger"]


@dataclass
class Judged:
    """A resolved entry: ``matched`` of the ``tokens`` proposals matched the committed text, in order."""

    source: int
    first: int  # proposals before this index were judged by the verify
    drafted: int
    matched: int
    conf: torch.Tensor | None  # [K] confidences (zero past the drafted ones)


@dataclass
class _Entry:
    source: int
    start: int  # position of the first proposal
    tokens: list[int]
    first: int
    conf: torch.Tensor | None


class ProposalLedger:
    """Drafted proposals per request, until the committed text judges them (module docstring)."""

    def __init__(self) -> None:
        self.entries: dict[str, list[_Entry]] = {}

    def add(
        self, request: str, source: int, start: int, tokens: list[int], first: int, conf: torch.Tensor | None
    ) -> None:
        """Keep ``tokens`` (proposals for positions ``start, start + 1, ...``) whose first ``first`` were
        verified."""
        if first < len(tokens):
            self.entries.setdefault(request, []).append(_Entry(source, start, tokens, first, conf))

    def resolve(self, request: str, committed: Sequence[int], length: int) -> list[Judged]:
        """Judge the request's entries against its committed tokens (``committed[:length]``): those whose
        positions are all committed, or that already mismatched."""
        pending = self.entries.get(request)
        if not pending:
            return []
        judged, kept = [], []
        for entry in pending:
            available = max(0, min(len(entry.tokens), length - entry.start))
            matched = 0
            while matched < available and int(committed[entry.start + matched]) == entry.tokens[matched]:
                matched += 1
            if matched < available or available == len(entry.tokens):
                judged.append(Judged(entry.source, entry.first, len(entry.tokens), matched, entry.conf))
            else:
                kept.append(entry)
        if kept:
            self.entries[request] = kept
        else:
            self.entries.pop(request, None)
        return judged

    def drop(self, request: str) -> None:
        """Forget a request (it finished or was preempted)."""
        self.entries.pop(request, None)

    def requests(self) -> list[str]:
        """Requests with entries waiting."""
        return list(self.entries)
