"""Prompt lookup: proposals copied from the text itself, found as vLLM's n-gram proposer finds them.

For each row, the longest n-gram (``min_ngram <= n <= max_ngram``) that ends the row's tokens and occurs earlier in
them; of its occurrences the earliest; the proposals are the (up to ``num_tokens``) tokens that followed it. Answers
repeat their prompt and themselves, so such proposals are often accepted, and they cost nothing to draft.

One batched search over a padded ``[B, L]`` token matrix (no loop over rows): every window of every row is
compared with that row's suffix, once per n-gram length.
"""

from __future__ import annotations

import torch

__all__ = ["prompt_lookup"]


def prompt_lookup(
    tokens: torch.Tensor,  # [B, L] each row's tokens, left-aligned (anything past its length is ignored)
    lengths: torch.Tensor,  # [B] tokens per row
    num_tokens: int,
    min_ngram: int = 2,
    max_ngram: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(proposals [B, num_tokens], counts [B])``: each row's prompt-lookup proposals (count 0: no match; entries
    past a row's count are 0)."""
    batch, width = tokens.shape
    lengths = lengths.to(tokens.device).long()
    proposals = tokens.new_zeros(batch, num_tokens)
    counts = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    start = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)  # where the proposals begin
    found = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    for n in range(min(max_ngram, width), min_ngram - 1, -1):  # the longest n-gram wins
        suffix_at = (lengths - n).clamp(min=0)[:, None] + torch.arange(n, device=tokens.device)  # [B, n]
        suffix = tokens.gather(1, suffix_at.clamp(max=width - 1))
        windows = tokens.unfold(1, n, 1)  # [B, L - n + 1, n]
        positions = torch.arange(windows.shape[1], device=tokens.device)
        # an occurrence before the suffix itself, with at least one token after it
        matches = (windows == suffix[:, None]).all(-1) & (positions[None] + n < lengths[:, None])
        matches &= (lengths >= n)[:, None] & ~found[:, None]
        earliest = torch.where(matches, positions[None], width).min(dim=1).values  # [B]
        hit = earliest < width
        start = torch.where(hit, earliest + n, start)
        found |= hit
    offsets = torch.arange(num_tokens, device=tokens.device)
    counts = torch.where(found, (lengths - start).clamp(min=0, max=num_tokens), counts)
    take = start.clamp(min=0)[:, None] + offsets  # [B, num_tokens]
    copied = tokens.gather(1, take.clamp(max=width - 1))
    proposals = torch.where(offsets[None] < counts[:, None], copied, proposals)
    return proposals, counts
