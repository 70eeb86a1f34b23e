"""Drafter state: what a drafter remembers between rounds, in two interchangeable backends.

A drafter holds up to two pieces of state (docs/design.md §8, "state"):

- **the MTP state**: the native MTP head's private KV cache over the committed pairs ``(x_{t+1}, h_t)``, plus
  ``g``, the MTP hidden of the last committed pair (it predicts the next T1);
- **the DFlash context**: the draft's cached context K/V over the committed positions' target features, plus the
  features committed since the last block (fed to the draft with the next block).

Each comes in two backends with the same methods, chosen by the drafter's ``fixed_slots`` flag:

- *dynamic* (:class:`MTPCache`, :class:`DFlashContext`): Transformers ``DynamicCache`` objects that grow by
  concatenation and are sized to what each round committed;
- *fixed slots* (:class:`MTPSlots`, :class:`SlotDFlashContext`): :class:`SlotCache` buffers of fixed capacity
  written at per-row offsets kept on the device, so every call has one shape (no host sync, CUDA-graph safe).
  After each verify they consume all ``K + 1`` verify slots at once; rejected slots go to a scratch column that no
  query sees.

Both backends produce exactly the same proposals (tested round by round for every family and strategy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from transformers.cache_utils import DynamicCache

from ..modeling.attention_masks import attention_mask_for_implementation, dflash_visibility
from ..modeling.modeling_dmtp import DMTPDraftModel
from ..modeling.native_mtp.head import NativeMTPHead
from .cuda_graphs import CUDAGraphCall
from .target_step import TargetStep

FAR = 2**40  # position given to unwritten and scratch slots: never before any anchor, never in any window
Select = Callable[[torch.Tensor], torch.Tensor]  # logits [B, V] -> tokens [B]


def _last_valid(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's entry at its last valid index (``values [B, n, ...]``) and whether the row has one (``[B]``)."""
    steps = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, steps, -1).amax(dim=-1)  # [B], -1 when the row has no valid entry
    index = last.clamp(min=0).view(-1, 1, *([1] * (values.dim() - 2))).expand(-1, 1, *values.shape[2:])
    return values.gather(1, index)[:, 0], last >= 0


# ----------------------------------------------------------------------------------------------------------------
# The MTP state


class MTPState(Protocol):
    """What a drafter calls on its MTP state (both backends implement it)."""

    def prefill(self, step: TargetStep) -> torch.Tensor:
        """Start from the prompt's pairs; returns ``g`` of every pair."""

    def advance(self, step: TargetStep) -> None:
        """Commit the pairs of a verify (accepted tokens + bonus)."""

    def predict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 logits ``[B, V]`` and the MTP hidden ``g`` ``[B, H]`` that predicts T1."""

    def propose(self, num_tokens: int, select: Select) -> tuple[torch.Tensor, torch.Tensor]:
        """Native MTP-k: chain the head ``num_tokens`` times; the committed state is left unchanged."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows``."""


class MTPCache:
    """The native MTP head's round state on a growing ``DynamicCache`` (the dynamic backend).

    Pairs ``(x_{t+1}, h_t)`` sit at the position ``t`` of their hidden state. Padded batches keep a 2D pair mask:
    padding pairs stay in the cache but no later pair attends to them, and ``g`` and the next position come from
    each row's last real pair.
    """

    def __init__(self, head: NativeMTPHead) -> None:
        self.head = head
        self.reset()

    def reset(self) -> None:
        """Forget the sequence(s): empty cache, no ``g``."""
        self.cache: DynamicCache | None = None
        self.last_hidden: torch.Tensor | None = None  # [B, H] g of the last committed pair
        self.next_position: torch.Tensor | None = None  # [B] position of the next pair
        self.pair_mask: torch.Tensor | None = None  # [B, committed], None while nothing is padded

    @property
    def num_committed(self) -> int:
        """Pairs in the cache (padding included)."""
        return 0 if self.cache is None else self.cache.get_seq_length()

    def _positions(self, position_ids, batch_size: int, length: int, device) -> torch.Tensor:
        offsets = torch.arange(length, device=device)
        if position_ids is None:
            if self.next_position is None:
                return offsets.expand(batch_size, length)
            return self.next_position[:, None] + offsets
        if isinstance(position_ids, int):
            return (offsets + position_ids).expand(batch_size, length)
        return position_ids.expand(batch_size, -1) if position_ids.ndim == 1 else position_ids

    def consume(
        self,
        next_token_ids: torch.LongTensor,  # [B, n] x_{t+1}
        target_hidden: torch.Tensor,  # [B, n, H] h_t
        position_ids: torch.Tensor | int | None = None,  # [B, n] t; int = first position; None = continue
        attention_mask: torch.Tensor | None = None,  # [B, n] 1 = real pair
    ) -> torch.Tensor:
        """Feed n pairs, commit them, remember ``g`` of each row's last real pair; returns ``g`` ``[B, n, H]``."""
        batch_size, length = next_token_ids.shape
        device = next_token_ids.device
        positions = self._positions(position_ids, batch_size, length, device)
        if self.cache is None:
            self.cache = DynamicCache(config=self.head.config)
        full_mask = None
        if attention_mask is not None or self.pair_mask is not None:
            past = self.pair_mask
            if past is None:
                past = torch.ones(batch_size, self.num_committed, dtype=torch.long, device=device)
            new = attention_mask if attention_mask is not None else torch.ones_like(next_token_ids)
            full_mask = torch.cat([past, new.to(device=device, dtype=past.dtype)], dim=-1)
        hidden = self.head(next_token_ids, target_hidden, positions, cache=self.cache, attention_mask=full_mask)
        self.pair_mask = full_mask
        if attention_mask is None:
            self.last_hidden, self.next_position = hidden[:, -1], positions[:, -1] + 1
            return hidden
        valid = attention_mask.to(device).bool()
        new_hidden, has_pair = _last_valid(hidden, valid)
        new_position = _last_valid(positions, valid)[0] + 1
        if self.last_hidden is None:
            self.last_hidden, self.next_position = new_hidden, new_position
        else:
            self.last_hidden = torch.where(has_pair[:, None], new_hidden, self.last_hidden)
            self.next_position = torch.where(has_pair, new_position, self.next_position)
        return hidden

    def prefill(self, step: TargetStep) -> torch.Tensor:
        """Start a new sequence with the prompt's pairs."""
        self.reset()
        return self.consume(step.next_tokens, step.mtp_hidden, step.positions, step.pair_mask())

    def advance(self, step: TargetStep) -> None:
        """Commit the pairs a verify kept."""
        self.consume(step.next_tokens, step.mtp_hidden, step.positions, step.pair_mask())

    def predict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 logits ``[B, V]`` from the remembered ``g``, and ``g`` itself (never one that consumed T1)."""
        if self.last_hidden is None:
            raise RuntimeError("the MTP state has no committed pair: call `prefill` first")
        return self.head.logits(self.last_hidden), self.last_hidden

    @torch.no_grad()
    def propose(self, num_tokens: int, select: Select | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP-k drafting as vLLM/SGLang do it: step 1 is :meth:`predict`; each later step feeds (previous draft,
        previous ``g``) at the next position. Returns ``(draft_ids [B, k], draft_logits [B, k, V])`` and crops the
        chained entries afterwards, so the committed state is unchanged."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        select = select or (lambda logits: logits.argmax(dim=-1))
        hidden = self.predict()[1]
        position = self.next_position - 1  # [B] position of the last committed pair
        logits = [self.head.logits(hidden)]
        tokens = [select(logits[-1])]
        mask, committed = self.pair_mask, self.num_committed
        try:
            for step in range(1, num_tokens):
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
                hidden = self.head(
                    tokens[-1][:, None], hidden[:, None], (position + step)[:, None], cache=self.cache,
                    attention_mask=mask,
                )[:, 0]  # fmt: skip
                logits.append(self.head.logits(hidden))
                tokens.append(select(logits[-1]))
        finally:
            if self.num_committed > committed:
                self.cache.crop(committed - self.num_committed)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)

    def crop(self, num_pairs: int) -> None:
        """Drop the last ``num_pairs`` committed pairs; ``g`` is forgotten until the next `consume`."""
        if num_pairs <= 0:
            return
        if self.cache is None or num_pairs > self.num_committed:
            raise ValueError(f"Cannot crop {num_pairs} pairs from an MTP cache holding {self.num_committed}")
        self.cache.crop(-num_pairs)
        if self.pair_mask is not None:
            self.pair_mask = self.pair_mask[:, :-num_pairs]
        if self.next_position is not None:
            self.next_position = self.next_position - num_pairs
        self.last_hidden = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows``."""
        if self.cache is not None:
            self.cache.reorder_cache(rows)
        for name in ("last_hidden", "next_position", "pair_mask"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, rows.to(value.device)))


class SlotCache:
    """Fixed-capacity K/V slots for a few attention layers, duck-typing the ``Cache.update`` call of HF layers.

    ``capacity`` real entries per row plus one scratch column (index ``capacity``). Call :meth:`prepare` before each
    forward with the validity and positions of its ``S`` new slots; the layers' ``update`` calls then write there.
    Slot j of row b lands at ``lengths[b] + (rank of j among the row's valid slots)``; validity of an entry is
    ``index < lengths``, so rolling back is a length decrement.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: torch.Tensor | None = None  # [B] committed entries per row
        self.positions: torch.Tensor | None = None  # [B, capacity + 1] position of each entry (FAR if none)
        self._write_index: torch.Tensor | None = None  # [B, S] where the forward in flight writes

    def reset(self, batch_size: int, device: torch.device) -> bool:
        """Empty the cache for ``batch_size`` rows; returns whether buffers were (re)allocated.

        Same batch size and device: reset in place (lengths to 0; K/V contents become unreachable), so graphs
        captured on these buffers stay valid across ``generate`` calls. Otherwise new buffers (K/V are allocated by
        the first ``update`` of each layer).
        """
        if self.lengths is not None and self.lengths.shape[0] == batch_size and self.lengths.device == device:
            self.lengths.zero_()
            self.positions.fill_(FAR)
            return False
        self.keys, self.values = {}, {}
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.positions = torch.full((batch_size, self.capacity + 1), FAR, dtype=torch.long, device=device)
        return True

    def prepare(self, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """Reserve the slots of the next forward: ``valid`` ``[B, S]`` bool, ``positions`` ``[B, S]``."""
        rank = valid.long().cumsum(-1) - 1
        index = torch.where(valid, self.lengths[:, None] + rank, self.capacity)
        self._write_index = index
        self.positions.scatter_(1, index, torch.where(valid, positions, FAR))  # scratch only ever receives FAR
        self.lengths.add_(valid.sum(-1))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[B, h, S, d]`` key/value slots in place; return the whole buffers ``[B, h, capacity + 1, d]``."""
        if layer_idx not in self.keys:
            batch, heads = key.shape[:2]
            self.keys[layer_idx] = key.new_zeros(batch, heads, self.capacity + 1, key.shape[-1])
            self.values[layer_idx] = value.new_zeros(batch, value.shape[1], self.capacity + 1, value.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        index = self._write_index[:, None, :, None]
        keys.scatter_(2, index.expand(*key.shape[:2], -1, key.shape[-1]), key.to(keys.dtype))
        values.scatter_(2, index.expand(*value.shape[:2], -1, value.shape[-1]), value.to(values.dtype))
        return keys, values

    def valid(self) -> torch.Tensor:
        """``[B, capacity + 1]`` which entries are real."""
        return torch.arange(self.capacity + 1, device=self.lengths.device)[None] < self.lengths[:, None]

    def visible_positions(self) -> torch.Tensor:
        """``[B, capacity + 1]`` entry positions, FAR for entries that are not real (masks compare positions)."""
        return torch.where(self.valid(), self.positions, FAR)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (new buffers: graphs captured on the old ones must be dropped)."""
        self.keys = {i: t.index_select(0, rows) for i, t in self.keys.items()}
        self.values = {i: t.index_select(0, rows) for i, t in self.values.items()}
        self.lengths, self.positions = self.lengths.index_select(0, rows), self.positions.index_select(0, rows)

    def state(self) -> list[torch.Tensor]:
        """The tensors a forward mutates besides K/V (saved and restored around graph warm-up)."""
        return [self.lengths, self.positions]


def _require_dense_masks(implementation: str, what: str) -> None:
    if implementation not in ("sdpa", "eager"):
        raise NotImplementedError(
            f"The fixed-slot drafter state builds dense masks for the {what}; its attention implementation is "
            f"{implementation!r}. Load it with attn_implementation='sdpa' (or 'eager')."
        )


class MTPSlots:
    """The native MTP head's round state on fixed slots (the fixed-slot backend of :class:`MTPCache`).

    ``g`` and the next position are device buffers updated in place, so a captured ``advance`` keeps working across
    rounds; with ``cuda_graphs`` the fixed-shape ``advance`` is replayed as a CUDA graph on CUDA.
    """

    def __init__(self, head: NativeMTPHead, capacity: int, cuda_graphs: bool = False) -> None:
        self.head = head
        self.cache = SlotCache(capacity)
        self.last_hidden: torch.Tensor | None = None  # [B, H]
        self.next_position: torch.Tensor | None = None  # [B]
        self.implementation = getattr(head.config, "_attn_implementation", None) or "sdpa"
        _require_dense_masks(self.implementation, "native MTP layer")
        self._advance = CUDAGraphCall(self._consume, self.state, enabled=cuda_graphs)

    def _mask(self, positions: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Query j sees real entries at positions <= its own; invalid queries see everything (no all-masked rows,
        # hence no NaN; their outputs are discarded).
        keys = self.cache.visible_positions()[:, None, None, :]  # [B, 1, 1, C+1]
        visible = (keys <= positions[:, None, :, None]) | ~valid[:, None, :, None]
        return attention_mask_for_implementation(visible, self.implementation, dtype)

    def _consume(self, tokens, hidden, positions, valid) -> None:
        """Consume ``S`` pairs of which ``valid`` ``[B, S]`` are real (fixed S: graph-safe)."""
        self.cache.prepare(valid, positions)
        mask = self._mask(positions, valid, self.last_hidden.dtype)
        g = self.head(tokens, hidden, positions, cache=self.cache, attention_mask=mask)  # [B, S, H]
        new_g, has_pair = _last_valid(g, valid)
        self.last_hidden.copy_(torch.where(has_pair[:, None], new_g.to(self.last_hidden.dtype), self.last_hidden))
        new_position = _last_valid(positions, valid)[0] + 1
        self.next_position.copy_(torch.where(has_pair, new_position, self.next_position))

    def prefill(self, step: TargetStep) -> None:
        """Start the sequences of a batch with all prompt pairs (any length, run eagerly). Buffers and captured
        graphs are reused when the batch size is the previous call's."""
        batch = step.next_tokens.shape[0]
        if self.cache.reset(batch, step.next_tokens.device) or self.last_hidden is None:
            self._advance.reset()
            hidden = step.mtp_hidden.shape[-1]
            self.last_hidden = step.mtp_hidden.new_zeros(batch, hidden, dtype=self.head.projection.weight.dtype)
            self.next_position = torch.zeros(batch, dtype=torch.long, device=step.next_tokens.device)
        else:
            self.last_hidden.zero_()
            self.next_position.zero_()
        self._consume(step.next_tokens, step.mtp_hidden, step.positions, step.valid())

    def advance(self, step: TargetStep) -> None:
        """Consume the verify's ``K + 1`` slots (accepted + bonus valid, the rest scratch)."""
        self._advance(step.next_tokens, step.mtp_hidden, step.positions, step.valid())

    def predict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 logits ``[B, V]`` and the MTP hidden ``g`` ``[B, H]`` that predicts T1."""
        return self.head.logits(self.last_hidden), self.last_hidden

    def propose(self, num_tokens: int, select: Select) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP-k chaining on the slots, as :meth:`MTPCache.propose`; the chained entries are rolled back."""
        saved_lengths = self.cache.lengths.clone()
        hidden = self.last_hidden
        position = self.next_position - 1
        logits = [self.head.logits(hidden)]
        tokens = [select(logits[-1])]
        ones = torch.ones_like(position, dtype=torch.bool)[:, None]
        for step in range(1, num_tokens):
            positions = (position + step)[:, None]
            self.cache.prepare(ones, positions)
            mask = self._mask(positions, ones, hidden.dtype)
            hidden = self.head(tokens[-1][:, None], hidden[:, None], positions, cache=self.cache, attention_mask=mask)
            hidden = hidden[:, 0]
            logits.append(self.head.logits(hidden))
            tokens.append(select(logits[-1]))
        self.cache.lengths.copy_(saved_lengths)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)

    def graph_calls(self) -> list[CUDAGraphCall]:
        """The captured stages (their replay counts, capture times and failures)."""
        return [self._advance]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (graphs are recaptured for the new batch size)."""
        self.cache.select_rows(rows)
        self.last_hidden = self.last_hidden.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)
        self._advance.reset()

    def state(self) -> list[torch.Tensor]:
        """Tensors ``advance`` mutates besides K/V."""
        return [*self.cache.state(), self.last_hidden, self.next_position]


# ----------------------------------------------------------------------------------------------------------------
# The DFlash context


class _ContextBase:
    """What both context backends share: the queue of committed features and the candidates' logits."""

    def __init__(self, draft: DMTPDraftModel) -> None:
        self.draft = draft
        self.pending: list[TargetStep] = []

    def start(self, step: TargetStep) -> None:
        """Start from the prompt's features (fed to the draft with the first block)."""
        self.pending = [step]

    def add(self, step: TargetStep) -> None:
        """Queue the features of newly committed positions."""
        self.pending.append(step)

    def take_pending(self) -> TargetStep:
        """The queued steps as one, and clear the queue."""
        steps, self.pending = self.pending, []
        return TargetStep.concat(steps)

    def candidate_logits(self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
        """One draft forward over the block ``[B, Q, H]``; the draft logits of the predicted slots ``[B, n, V]``."""
        hidden = self.run_block(block_embeds, anchor_positions, self.take_pending())
        return self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])

    def run_block(self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor, new: TargetStep) -> torch.Tensor:
        """Append ``new``'s context and run the block; returns the final-normed block hidden ``[B, Q, H]``."""
        raise NotImplementedError


class DFlashContext(_ContextBase):
    """The DFlash draft's context on a growing ``DynamicCache`` (the dynamic backend).

    Entries are appended in commit order with their own positions (RoPE) and validity: the block attends to every
    real context entry, so their order in the cache does not matter and padded entries are simply masked.
    """

    def __init__(self, draft: DMTPDraftModel) -> None:
        super().__init__(draft)
        self.cache = DynamicCache()
        self.positions: torch.Tensor | None = None  # [B, C] positions of the cached entries
        self.mask: torch.Tensor | None = None  # [B, C] validity of the cached entries

    def run_block(self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor, new: TargetStep) -> torch.Tensor:
        """Append ``new``'s context and run the block; returns the final-normed block hidden ``[B, Q, H]``."""
        self.positions = new.positions if self.positions is None else torch.cat([self.positions, new.positions], 1)
        self.mask = new.valid() if self.mask is None else torch.cat([self.mask, new.valid()], 1)
        block_positions = self.draft.block_position_ids(anchor_positions)
        return self.draft(
            block_embeds,
            new.features,
            torch.cat([new.positions, block_positions], dim=1),
            cache=self.cache,
            context_mask=self.mask,
            context_positions=self.positions,
        ).last_hidden_state

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of the cache, the entry bookkeeping and any queued features."""
        self.cache.reorder_cache(rows)
        if self.positions is not None:
            self.positions, self.mask = self.positions[rows], self.mask[rows]
        self.pending = [step.select_rows(rows) for step in self.pending]


class SlotDFlashContext(_ContextBase):
    """The DFlash draft's context on fixed slots (the fixed-slot backend of :class:`DFlashContext`).

    Every block after the first reads exactly the ``K + 1`` slots of the last verify, so the block forward (context
    write + block + draft LM head) has one shape; with ``cuda_graphs`` it is replayed as a CUDA graph on CUDA. The
    first block carries the prompt's features and runs eagerly.
    """

    def __init__(self, draft: DMTPDraftModel, capacity: int, cuda_graphs: bool = False) -> None:
        super().__init__(draft)
        self.cache = SlotCache(capacity)
        self.implementation = draft.config._attn_implementation or "sdpa"
        _require_dense_masks(self.implementation, "DFlash draft")
        attentions = {layer.self_attn.layer_type: layer.self_attn for layer in draft.layers}
        self.layer_kinds = {kind: (attn.block_causal, attn.sliding_window) for kind, attn in attentions.items()}
        self._forward = CUDAGraphCall(self._block_forward, self.cache.state, enabled=cuda_graphs)

    def start(self, step: TargetStep) -> None:
        """Empty slots for the batch (in place when its size is the previous call's: graphs stay valid); queue the
        prompt features."""
        if self.cache.reset(step.positions.shape[0], step.positions.device):
            self._forward.reset()
        self._prompt_block = True
        super().start(step)

    def run_block(self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor, new: TargetStep) -> torch.Tensor:
        """Write ``new``'s context into the slots and run the block (a graph replay when shapes are the round's)."""
        args = (block_embeds, anchor_positions, new.features, new.positions, new.valid())
        if self._prompt_block:  # the first block carries the prompt's features: another shape, run eagerly
            self._prompt_block = False
            return self._forward.fn(*args)
        return self._forward(*args)

    def _block_forward(self, block_embeds, anchor_positions, features, positions, valid) -> torch.Tensor:
        self.cache.prepare(valid, positions)
        block_positions = self.draft.block_position_ids(anchor_positions)  # [B, Q]
        key_positions = torch.cat([self.cache.visible_positions(), block_positions], dim=1)[:, None, None, :]
        key_blocks = torch.cat([torch.full_like(self.cache.positions, -1), torch.zeros_like(block_positions)], dim=1)
        masks = {}
        for kind, (causal, window) in self.layer_kinds.items():
            visible = dflash_visibility(
                block_positions[:, None, :, None], 0, anchor_positions[:, None, None, None], key_positions,
                key_blocks[:, None, None, :], causal=causal, window=window,
            )  # fmt: skip
            masks[kind] = attention_mask_for_implementation(visible, self.implementation, block_embeds.dtype)
        return self.draft(
            block_embeds,
            features,
            torch.cat([positions, block_positions], dim=1),
            attention_mask=masks,
            cache=self.cache,
        ).last_hidden_state

    def graph_calls(self) -> list[CUDAGraphCall]:
        """The captured stages (their replay counts, capture times and failures)."""
        return [self._forward]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of the slots and of queued features (graphs are recaptured)."""
        self.cache.select_rows(rows)
        self._forward.reset()
        self.pending = [step.select_rows(rows) for step in self.pending]
