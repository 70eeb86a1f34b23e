"""Prompt lookup competing with the draft in ``verify_length="auto"`` rounds (the plugin's policy, in ``generate``).

Each round, every row's prompt-lookup proposals (the tokens that followed the earliest earlier occurrence of the
longest 2..4-gram ending the row: `dmtp_policy.prompt_lookup`, as vLLM's n-gram proposer finds them) compete with
the draft's candidates. A batch verifies one padded rectangle, so the rows share one width: for each width w, each
row takes whichever proposal is expected to commit more at w, and the round takes the w with the most expected
tokens per second (`dmtp_policy.planner.best_uniform_sources`). What prompt lookup is accepted per position is
learned from the rows that verified it.

Lossless whatever is chosen: a lookup row's candidates are verified exactly as a draft's (greedy: matched against
the target's argmax; sampling: rejection sampling against a one-hot ``q``, the distribution a copied token was
"drawn" from). The drafter's state follows the committed tokens either way.
"""

from __future__ import annotations

import torch

from dmtp_policy.lookup import prompt_lookup
from dmtp_policy.planner import best_uniform_sources

from .accept.batch import ActiveBatch
from .drafters.base import Proposal
from .widths import AutoWidth

__all__ = ["LookupRounds"]

LOOKUP_MIN_NGRAM = 2
LOOKUP_MAX_NGRAM = 4


class LookupRounds:
    """Prompt-lookup proposals for the rows of one call, and the choice between them and the draft's."""

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, policy: AutoWidth, vocab: int | None
    ) -> None:
        self.vocab = vocab  # the size of the scores a sampled verify compares (None: greedy, no scores needed)
        self.prompts = input_ids  # [B0, P], left-padded
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        self.prompt_lengths = mask.sum(-1)  # [B0]
        self.policy = policy
        self.estimate = policy.lookup_estimate
        self.lookup_rows: torch.Tensor | None = None  # [B] the rows that verify lookup this round
        self.width = 0

    def history(self, batch: ActiveBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each active row's tokens so far, left-aligned: ``[B, L]`` and their lengths ``[B]``."""
        rows = batch.rows
        padded_width = self.prompts.shape[1]
        generated = batch.tokens[rows]  # [B, columns + 1]
        both = torch.cat([self.prompts[rows], generated], dim=1)
        start = padded_width - self.prompt_lengths[rows]  # first real prompt token
        lengths = self.prompt_lengths[rows] + batch.num_generated
        index = (start[:, None] + torch.arange(both.shape[1] - int(start.min()), device=both.device)).clamp(
            max=both.shape[1] - 1
        )
        return both.gather(1, index), lengths

    def merge(self, proposal: Proposal, batch: ActiveBatch, num_candidates: int) -> Proposal:
        """The round's candidates: per row the draft's or prompt lookup's, at one width (module docstring)."""
        tokens, lengths = self.history(batch)
        lookup, counts = prompt_lookup(tokens, lengths, num_candidates, LOOKUP_MIN_NGRAM, LOOKUP_MAX_NGRAM)
        self.lookup_rows = None
        if not bool((counts > 0).any()):
            return proposal
        drafted = proposal.tokens.shape[1]
        draft_gains = self.policy.drafted_gains(batch.rows.shape[0], drafted)  # [B, K] (-inf past the drafted)
        positions = torch.arange(num_candidates, device=counts.device)[None]
        lookup_gains = torch.tensor(self.estimate.prior).cumprod(0).expand(counts.shape[0], -1)
        lookup_gains = torch.where(positions.cpu() < counts.cpu()[:, None], lookup_gains, float("-inf"))
        width, source = best_uniform_sources(torch.stack([draft_gains, lookup_gains]), self.policy.width_seconds())
        use_lookup = torch.as_tensor(source == 1, device=counts.device) & (counts > 0)
        if width == 0 or not bool(use_lookup.any()):
            return proposal  # the draft's own choice stands
        self.lookup_rows, self.width = use_lookup, width
        filler = batch.last_tokens[:, None].expand(-1, width)  # past a short match: verified, and rejected
        lookup = torch.where(positions[:, :width] < counts[:, None], lookup[:, :width], filler)
        draft = proposal.tokens[:, :width]
        if draft.shape[1] < width:  # draft rows verify the filler past what was drafted
            draft = torch.cat([draft, filler[:, draft.shape[1] :]], dim=1)
        merged = torch.where(use_lookup[:, None], lookup, draft)
        self.policy.restrict_to_draft(~use_lookup, width)
        return Proposal(merged, self._scores(proposal, merged, use_lookup, width))

    def learn(self, num_valid: list[int] | None) -> None:
        """The rows that verified lookup teach its estimate (call before the policy's own `learn`)."""
        if self.lookup_rows is None or num_valid is None:
            return
        accepted = torch.tensor([max(count - 1, 0) for count in num_valid])
        rows = self.lookup_rows.cpu()
        self.estimate.observe(torch.full((int(rows.sum()),), self.width), accepted[rows])
        self.lookup_rows = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Finished rows left the batch (an unanswered round keeps its rows)."""
        if self.lookup_rows is not None:
            self.lookup_rows = self.lookup_rows[rows]

    def _scores(self, proposal: Proposal, merged: torch.Tensor, use_lookup: torch.Tensor, width: int):
        """The distribution each candidate came from: the draft's, or one-hot where it was copied (or filled)."""
        if self.vocab is None:
            return None
        one_hot = torch.full((*merged.shape, self.vocab), float("-inf"), device=merged.device)
        one_hot.scatter_(-1, merged[..., None], 0.0)
        if proposal.scores is None:  # a round the draft sat out: every candidate was copied or filled
            return one_hot
        draft = proposal.scores[:, :width]
        if draft.shape[1] < width:
            draft = torch.cat([draft, one_hot[:, draft.shape[1] :]], dim=1)
        return torch.where(use_lookup[:, None, None], one_hot, draft.to(one_hot.dtype))
