"""Token selection and the four lossless verification rules (greedy, match, rejection, block) (docs/design.md §3).

Every distribution here is *processed*: the generation's logits processors (repetition penalty, temperature,
top-k, top-p, ...) are applied with the exact prefix each position sees, identically for draft and target, so
that a draft's ``q`` is the distribution its token was really drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import LogitsProcessorList

VerifyMode = Literal["greedy", "match", "rejection", "block"]
VERIFY_MODES = ("greedy", "match", "rejection", "block")


def process_logits(
    logits: torch.Tensor,  # [B, V] raw logits for the position after `prefix`
    prefix: torch.Tensor,  # [B, L] the tokens that position sees
    logits_processor: LogitsProcessorList | None,
) -> torch.Tensor:
    """Scores ``[B, V]`` (float32) after the generation's logits processors."""
    scores = logits.float()
    if logits_processor:
        scores = logits_processor(prefix, scores)
    return scores


def select_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Argmax or one sample per row of processed scores ``[..., V]`` -> ``[...]``."""
    if not do_sample:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1).view(probs.shape[:-1])


@dataclass
class Verdict:
    """Outcome of verifying K candidates: ``num_accepted`` ``[B]`` in 0..K and the correction/bonus ``[B]``."""

    num_accepted: torch.Tensor
    bonus: torch.Tensor


def _leading_true(matches: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``[B, K]``."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def verify(
    mode: VerifyMode,
    candidates: torch.Tensor,  # [B, K]
    target_scores: torch.Tensor,  # [B, K+1, V] processed target scores at [A, T1..TK]
    draft_scores: torch.Tensor | None = None,  # [B, K, V] processed scores each candidate was drawn from
    draft_sampled: bool = True,  # False: candidates are the argmax of draft_scores (q is one-hot)
) -> Verdict:
    """Accept the longest valid prefix of ``candidates`` and draw one token from the target after it.

    ``greedy``: candidates must equal the target argmax. ``match`` (the blog's target-only verification): sample the
    target at every slot and accept while samples equal candidates; the bonus is the first differing sample.
    ``rejection`` (Leviathan et al.): accept candidate i with probability ``min(1, p_i/q_i)``, on rejection
    resample from ``norm(max(p - q, 0))``, and if all are accepted sample the bonus from ``p``. ``block`` (Sun et
    al.): the block is accepted jointly (`block_verify`), never fewer tokens than ``rejection`` in expectation. All
    four leave the output distribution equal to the target's. Greedy drafts (``draft_sampled=False``) were drawn
    from a one-hot ``q`` at the candidate, which is the ``q`` used, so the rule stays exact for them too.
    """
    num_candidates = candidates.shape[1]
    if num_candidates == 0 and mode in VERIFY_MODES:  # a round that drafted nothing is a plain decoding step
        step = target_scores[:, 0]
        none = torch.zeros(candidates.shape[0], dtype=torch.long, device=candidates.device)
        return Verdict(none, select_tokens(step, do_sample=mode != "greedy"))
    if mode == "greedy":
        target_tokens = target_scores.argmax(dim=-1)  # [B, K+1]
        n = _leading_true(candidates == target_tokens[:, :num_candidates])
        return Verdict(n, target_tokens.gather(1, n[:, None])[:, 0])
    if mode == "match":
        target_tokens = select_tokens(target_scores, do_sample=True)
        n = _leading_true(candidates == target_tokens[:, :num_candidates])
        return Verdict(n, target_tokens.gather(1, n[:, None])[:, 0])
    if mode not in ("rejection", "block"):
        raise ValueError(f"Unknown verification mode {mode!r}; expected one of {VERIFY_MODES}.")
    if draft_scores is None:
        raise ValueError(f"{mode} verification needs the draft distributions the candidates were drawn from.")
    p = target_scores.softmax(dim=-1)  # [B, K+1, V]
    if draft_sampled:
        q = draft_scores.softmax(dim=-1)  # [B, K, V]
    else:
        q = torch.zeros_like(p[:, :num_candidates]).scatter_(2, candidates[..., None], 1.0)
    if mode == "block":
        return block_verify(candidates, p, q)
    p_tok = p[:, :num_candidates].gather(2, candidates[..., None])[..., 0]
    q_tok = q.gather(2, candidates[..., None])[..., 0]
    # u < p/q without dividing by q; strict, so that a token the target forbids (p = 0) is never accepted, not even
    # when u = 0
    accept = torch.rand_like(p_tok) * q_tok < p_tok
    n = _leading_true(accept)
    # Residual distribution at the first rejected slot; the plain target distribution after all K are accepted.
    q_padded = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # [B, K+1, V] (K may be 0)
    residual = (p - q_padded).clamp(min=0)
    index = n[:, None, None].expand(-1, 1, p.shape[-1])
    residual_n = residual.gather(1, index)[:, 0]
    p_n = p.gather(1, index)[:, 0]
    # Where p == q exactly the residual is empty; p itself is then the correct (and only) choice.
    mass = residual_n.sum(dim=-1, keepdim=True)
    dist = torch.where(mass > 0, residual_n / mass.clamp(min=1e-30), p_n)
    bonus = torch.multinomial(dist, 1)[:, 0]
    return Verdict(n, bonus)


def block_verify(candidates: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> Verdict:
    """Block verification (Sun et al., ICLR 2025): the block is accepted jointly, never fewer tokens in expectation
    than token-wise rejection, the output exactly the target's distribution.

    ``p`` ``[B, K+1, V]`` target and ``q`` ``[B, K, V]`` draft distributions. With ``w_0 = 1`` and
    ``w_i = min(w_{i-1} p_i(x_i) / q_i(x_i), 1)``, stopping after i candidates has weight ``h_K = w_K`` and, for
    ``i < K``, ``h_i = m_i / (m_i + 1 - w_i)`` with ``m_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0)``
    (``h_0 = 1``); the number accepted is the largest i with ``u_i <= h_i`` (independent uniforms), and the
    correction token is drawn from ``norm(max(w_i p - q, 0))`` there (``p`` itself after all K, or where that
    residual is empty).
    """
    batch, num_candidates = candidates.shape
    ratio = p[:, :num_candidates].gather(2, candidates[..., None])[..., 0] / q.gather(2, candidates[..., None])[..., 0]
    weights = [torch.ones(batch, dtype=ratio.dtype, device=ratio.device)]
    for i in range(num_candidates):  # K (<= a few) elementwise steps, on the device
        weights.append(torch.minimum(weights[-1] * ratio[:, i], torch.ones_like(ratio[:, i])))
    w = torch.stack(weights, dim=1)  # [B, K+1]
    residual = (w[:, :num_candidates, None] * p[:, :num_candidates] - q).clamp(min=0)  # [B, K, V]
    mass = residual.sum(dim=-1)  # [B, K]
    denominator = mass + 1 - w[:, :num_candidates]
    stop = torch.where(denominator > 0, mass / denominator.clamp(min=1e-30), torch.ones_like(mass))
    stop = torch.cat([stop, w[:, -1:]], dim=1)  # [B, K+1]: h_0..h_K
    stop[:, 0] = 1.0
    passes = torch.rand_like(stop) <= stop
    steps = torch.arange(num_candidates + 1, device=candidates.device)
    n = torch.where(passes, steps, torch.zeros_like(steps)).amax(dim=1)  # [B] the largest i that passed
    residual = torch.cat([residual, torch.zeros_like(p[:, :1])], dim=1)  # [B, K+1, V]
    index = n[:, None, None].expand(-1, 1, p.shape[-1])
    residual_n, p_n = residual.gather(1, index)[:, 0], p.gather(1, index)[:, 0]
    total = residual_n.sum(dim=-1, keepdim=True)
    dist = torch.where((total > 0) & (n[:, None] < num_candidates), residual_n / total.clamp(min=1e-30), p_n)
    return Verdict(n, torch.multinomial(dist, 1)[:, 0])
