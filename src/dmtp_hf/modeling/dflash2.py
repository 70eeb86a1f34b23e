"""The two pieces DFlash2 adds to a DFlash draft (z-lab's ``DFlash2DraftModel``), as modules of the one draft model.

1. ``GroupedDynamicCausalConv``, one around each sublayer of every decoder layer (``attention_conv``,
   ``mlp_conv``). Along the slots of a block, causally, with ``k`` taps: ``prepare`` convolves the normed sublayer
   input, ``finish`` the sublayer output, each tap weight a static per-channel kernel plus a dynamic per-group
   coefficient projected from the normed input::

       out[l, c] = sum_t (base[side, t, c] + dyn[l, side, t, c // group_size]) * x[l - t, c]   (x[< 0] = 0)

   Only block slots are convolved (never the context K/V), and never across blocks (training lays blocks out back
   to back).
2. ``CandidateSelector``: a path walk over the top-k draft tokens of each predicted slot. With ``z = P h`` (the
   slot's final-normed hidden projected to rank ``r``) and the token ``prev`` chosen at the slot before::

       score(cand) = unary(cand) + < predecessor[prev] * z , successor[cand] >

   ``unary`` is the slot's (processed) draft scores; the walk starts from the token before the first predicted slot
   (the anchor A, or T1 in DMTP(D2)) and picks the argmax, or samples from the softmax over the k candidates.

Identity initialisation (SpecForge's): tap 0 = 1, other taps and the kernel projection 0, successor codebook 0.
The convolutions are then exactly the identity and the walk picks the argmax of the draft logits: a fresh
DFlash2 proposes what the DFlash draft with the same weights proposes. Checkpoint names are z-lab's: the bare
parameters ``base_kernel``, ``predecessor_codebook`` and ``successor_codebook``.
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_dmtp import DMTPConfig

__all__ = ["CandidateSelector", "GroupedDynamicCausalConv"]


class GroupedDynamicCausalConv(nn.Module):
    """Causal grouped convolution along the slots of each block, around one sublayer (see the module docstring).

    ``base_kernel`` ``[2, k, H]``: index 0 is the input (``prepare``) side, 1 the output (``finish``) side;
    ``kernel_projection`` ``H -> 2 * k * G`` (``G = H / group_size``), viewed ``[2, k, G]``.
    """

    def __init__(self, config: DMTPConfig):
        super().__init__()
        hidden = config.hidden_size
        self.taps = config.dflash_config["conv_kernel_size"]
        self.group_size = config.dflash_config["conv_group_size"]
        self.block_length = config.block_length
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * self.taps * (hidden // self.group_size), bias=False)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, Q, H]`` (Q = whole blocks), ``dynamic`` ``[B, Q, k, G]``, ``base`` ``[k, H]``."""
        batch, length, hidden = x.shape
        blocks = x.view(batch, length // self.block_length, self.block_length, hidden).float()
        dynamic = dynamic.float().repeat_interleave(self.group_size, dim=-1)  # [B, Q, k, H]
        dynamic = dynamic.view(batch, -1, self.block_length, self.taps, hidden)
        out = torch.zeros_like(blocks)
        for tap in range(self.taps):  # k taps (2 in every published DFlash2): a few elementwise ops each
            shifted = nn.functional.pad(blocks[:, :, : self.block_length - tap], (0, 0, tap, 0))  # x[l - tap]
            out = out + (base[tap].float() + dynamic[..., tap, :]) * shifted
        return out.view(batch, length, hidden).to(x.dtype)

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the output side's dynamic coefficients (both from ``hidden``)."""
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.taps, -1)  # [B, Q, 2, k, G]
        return self._convolve(hidden, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, output: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The convolved sublayer output."""
        return self._convolve(output, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """DFlash2's path walk over the top-k candidates of each predicted slot (see the module docstring)."""

    def __init__(self, config: DMTPConfig):
        super().__init__()
        rank = config.dflash_config["selector_rank"]
        self.top_k = config.dflash_config["selector_top_k"]
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))

    def scores(
        self,
        unary: torch.Tensor,
        projected: torch.Tensor,
        previous: torch.Tensor,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates ``[..., k]`` (the top-k of ``unary [..., V]``) and their walk scores ``[..., k]`` after the
        token ``previous [...]``, for slots whose projected hidden is ``projected [..., r]``. ``unary`` over a draft
        vocabulary ``[..., Vd]``: ``token_ids [Vd]`` maps its columns to target ids."""
        top, candidates = unary.topk(self.top_k, dim=-1)
        candidates = token_ids[candidates] if token_ids is not None else candidates
        context = self.predecessor_codebook[previous] * projected  # [..., r]
        transition = torch.einsum("...r,...kr->...k", context.float(), self.successor_codebook[candidates].float())
        return candidates, top.float() + transition

    def step(
        self, unary: torch.Tensor, projected: torch.Tensor, previous: torch.Tensor, sample: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot of the walk: the chosen token ``[B]`` and the walk's distribution as scores ``[B, V]`` (its
        candidates' scores, ``-inf`` elsewhere: ``softmax`` of it is exactly the ``q`` the token was drawn from)."""
        candidates, scores = self.scores(unary.float(), projected, previous)
        if sample:
            choice = torch.multinomial(scores.softmax(dim=-1), 1)[:, 0]
        else:
            choice = scores.argmax(dim=-1)
        token = candidates.gather(1, choice[:, None])[:, 0]
        walk = torch.full_like(unary, float("-inf"), dtype=torch.float32).scatter(1, candidates, scores)
        return token, walk
