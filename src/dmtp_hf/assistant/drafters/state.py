"""Drafter state: what a drafter remembers between rounds (docs/design.md §8, "state").

A drafter holds up to two pieces of state, both on one storage, :class:`SlotKV`:

- :class:`MTPState`, the native MTP head's: its K/V over the committed pairs ``(x_{t+1}, h_t)``, plus ``g``, the
  MTP hidden of the last committed pair (it predicts the next T1);
- :class:`DFlashContext`, the DFlash draft's: its context K/V over the committed positions' target features, plus
  the features committed since the last block (fed to the draft with the next block).

:class:`SlotKV` keeps each row's entries in slots written at per-row offsets on the device, so rolling back is a
length decrement, nothing is ever concatenated, and rows of a batch may hold different numbers of entries. Attention
spans the filled prefix of the slots (the longest row), never the capacity.

``fixed_shapes`` (the fast path) changes only shapes, never proposals: every advance consumes all ``K + 1`` verify
slots (the rejected ones go to a scratch slot no query sees), spans are rounded up to powers of two and masks are
always materialised, so the MTP advance and the DFlash block replay as CUDA graphs on CUDA (``cuda_graphs``).
Without it, advances take only the committed width and masks are dropped where every key is visible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch

from ...modeling.attention_masks import FAR, AttentionLayout, draft_attention_masks, layer_kinds
from ...modeling.modeling_dmtp import DMTPDraftModel
from ...modeling.native_mtp.head import NativeMTPHead
from ..target.step import TargetStep
from .cuda_graphs import CUDAGraphCall

Select = Callable[[torch.Tensor], torch.Tensor]  # logits [B, V] -> tokens [B]
INITIAL_CAPACITY = 256  # slots per row before the first growth (without fixed shapes)


def _last_valid(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's entry at its last valid index (``values [B, n, ...]``) and whether the row has one (``[B]``)."""
    steps = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, steps, -1).amax(dim=-1)  # [B], -1 when the row has no valid entry
    index = last.clamp(min=0).view(-1, 1, *([1] * (values.dim() - 2))).expand(-1, 1, *values.shape[2:])
    return values.gather(1, index)[:, 0], last >= 0


class SlotKV:
    """Key/value slots of a few attention layers, duck-typing the ``Cache.update`` call of Transformers layers.

    Row b's entries are its slots ``0 .. lengths[b] - 1`` in commit order; slot ``capacity`` is scratch. A forward
    over ``S`` new entries calls :meth:`begin` on the host (capacity, span), then :meth:`prepare` on the device
    (where each entry goes), then its layers' ``update`` calls write there and read the slots ``[:span]``.
    ``lengths_host`` mirrors ``lengths`` from counts the loop already holds, so nothing here synchronises.
    """

    def __init__(self, fixed_shapes: bool = False) -> None:
        self.fixed_shapes = fixed_shapes
        self.limit: int | None = None  # fixed shapes: the capacity, reserved for the whole call
        self.capacity = 0
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [B, heads, capacity + 1, d]
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: torch.Tensor | None = None  # [B] entries per row
        self.positions: torch.Tensor | None = None  # [B, capacity + 1] position of each entry (FAR if none)
        self.lengths_host: list[int] = []
        self.span = 0  # slots every attention call reads: the longest row (a power of two with fixed shapes)
        self._write_index: torch.Tensor | None = None  # [B, S] where the forward in flight writes

    def reset(self, batch_size: int, device: torch.device) -> bool:
        """Empty the slots for ``batch_size`` rows; returns whether buffers were (re)allocated. Same batch size,
        device and capacity: reset in place, so graphs captured on these buffers stay valid across calls."""
        capacity = self.limit if self.fixed_shapes else INITIAL_CAPACITY
        same = self.lengths is not None and self.lengths.shape[0] == batch_size and self.lengths.device == device
        self.lengths_host = [0] * batch_size
        self.span = 0
        if same and self.capacity == capacity:
            self.lengths.zero_()
            self.positions.fill_(FAR)
            return False
        self.keys = {}
        self.values = {}
        self.capacity = capacity
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.positions = torch.full((batch_size, capacity + 1), FAR, dtype=torch.long, device=device)
        return True

    def begin(self, num_valid: list[int] | None, width: int) -> int:
        """Host side of a forward over ``width`` new entries per row, ``num_valid[b]`` of them real (``None``: all):
        grow if needed, update the host lengths; returns the new span."""
        new = num_valid if num_valid is not None else [width] * len(self.lengths_host)
        self.lengths_host = [length + n for length, n in zip(self.lengths_host, new, strict=True)]
        longest = max(self.lengths_host, default=0)
        if longest > self.capacity:
            if self.fixed_shapes:
                raise ValueError(f"{longest} entries per row exceed the {self.capacity} reserved fixed slots")
            self._grow(max(longest, 2 * self.capacity))
        self.span = min(self.capacity, 1 << max(longest - 1, 0).bit_length()) if self.fixed_shapes else longest
        return self.span

    def _grow(self, capacity: int) -> None:
        """Move every buffer to ``capacity`` slots (amortised O(1) per entry: capacities double)."""

        def grown(buffer: torch.Tensor, dim: int, fill) -> torch.Tensor:
            shape = list(buffer.shape)
            shape[dim] = capacity + 1
            out = buffer.new_full(shape, fill)
            out.narrow(dim, 0, self.capacity).copy_(buffer.narrow(dim, 0, self.capacity))
            return out

        self.keys = {i: grown(t, 2, 0) for i, t in self.keys.items()}
        self.values = {i: grown(t, 2, 0) for i, t in self.values.items()}
        self.positions = grown(self.positions, 1, FAR)
        self.capacity = capacity

    def prepare(self, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """Device side: the next forward's ``S`` entries, ``valid`` ``[B, S]`` bool at ``positions`` ``[B, S]``."""
        rank = valid.long().cumsum(-1) - 1
        index = torch.where(valid, self.lengths[:, None] + rank, self.capacity)
        self._write_index = index
        self.positions.scatter_(1, index, torch.where(valid, positions, FAR))  # scratch only ever receives FAR
        self.lengths.add_(valid.sum(-1))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[B, h, S, d]`` key/value entries in place; return the filled slots ``[B, h, span, d]``."""
        if layer_idx not in self.keys:
            batch, heads = key.shape[:2]
            self.keys[layer_idx] = key.new_zeros(batch, heads, self.capacity + 1, key.shape[-1])
            self.values[layer_idx] = value.new_zeros(batch, value.shape[1], self.capacity + 1, value.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        index = self._write_index[:, None, :, None]
        keys.scatter_(2, index.expand(*key.shape[:2], -1, key.shape[-1]), key.to(keys.dtype))
        values.scatter_(2, index.expand(*value.shape[:2], -1, value.shape[-1]), value.to(values.dtype))
        return keys[:, :, : self.span], values[:, :, : self.span]

    def key_positions(self) -> torch.Tensor:
        """``[B, span]`` positions of the slots attention reads."""
        return self.positions[:, : self.span]

    def key_valid(self) -> torch.Tensor | None:
        """``[B, span]`` which slots are real; ``None`` when all are (known on the host, without fixed shapes)."""
        if not self.fixed_shapes and min(self.lengths_host, default=0) == self.span:
            return None
        return torch.arange(self.span, device=self.lengths.device)[None] < self.lengths[:, None]

    def save(self) -> tuple[torch.Tensor, list[int], int]:
        """The lengths, to :meth:`restore` after temporary entries (MTP-k chaining)."""
        return self.lengths.clone(), list(self.lengths_host), self.span

    def restore(self, saved: tuple[torch.Tensor, list[int], int]) -> None:
        """Forget every entry written since :meth:`save`."""
        self.lengths.copy_(saved[0])
        self.lengths_host = list(saved[1])
        self.span = saved[2]

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only batch ``rows`` (new buffers: graphs captured on the old ones must be dropped)."""
        self.keys = {i: t.index_select(0, rows) for i, t in self.keys.items()}
        self.values = {i: t.index_select(0, rows) for i, t in self.values.items()}
        self.lengths = self.lengths.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
        self.lengths_host = [self.lengths_host[i] for i in rows_host]

    def state(self) -> list[torch.Tensor]:
        """The tensors a forward mutates besides K/V (saved and restored around graph warm-up)."""
        return [self.lengths, self.positions]


class MTPState:
    """The native MTP head's round state (see the module docstring).

    Pairs ``(x_{t+1}, h_t)`` sit at the position ``t`` of their hidden state. ``g`` and the next position are
    device buffers updated in place; padded or rejected pairs are never written, and ``g`` comes from each row's
    last real pair.
    """

    def __init__(self, head: NativeMTPHead, fixed_shapes: bool = False, cuda_graphs: bool = False) -> None:
        self.head = head
        self.kv = SlotKV(fixed_shapes)
        self.fixed_shapes = fixed_shapes
        self.last_hidden: torch.Tensor | None = None  # [B, H] g of the last committed pair
        self.next_position: torch.Tensor | None = None  # [B] position of the next pair
        # committed pairs not yet fed to the head (without fixed shapes): `advance` queues, the next `flush` (before
        # any use of `g`) feeds them in one forward, so rounds that never draft (auto width's plain rounds) cost
        # one batched forward at the next drafting round instead of one forward each
        self.pending: list[TargetStep] = []
        implementation = getattr(head.config, "_attn_implementation", None) or "sdpa"
        # Transformers' flex-attention layers take a dense additive mask as a score mask.
        self.implementation = "eager" if implementation == "flex_attention" else implementation
        self._advance = CUDAGraphCall(self._consume, self.state, enabled=cuda_graphs and fixed_shapes)

    @property
    def num_committed(self) -> int:
        """The most pairs any row holds."""
        self.flush()
        return max(self.kv.lengths_host, default=0)

    def reset(self) -> None:
        """Forget the sequences (the next :meth:`start` or :meth:`consume` begins new ones)."""
        self.kv.lengths_host = []
        self.pending = []

    def _begin_batch(self, batch_size: int, device: torch.device) -> None:
        """Empty slots, ``g`` and positions zero (buffers kept when the batch is the previous call's)."""
        if self.kv.reset(batch_size, device) or self.last_hidden is None:
            self._advance.reset()
            dtype = self.head.projection.weight.dtype
            self.last_hidden = torch.zeros(batch_size, self.head.projection.out_features, dtype=dtype, device=device)
            self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        else:
            self.last_hidden.zero_()
            self.next_position.zero_()

    def start(self, step: TargetStep) -> None:
        """Start the sequences of a batch with all prompt pairs (any length, eagerly)."""
        self._begin_batch(step.positions.shape[0], step.positions.device)
        self.pending = []
        self.kv.begin(step.num_valid, step.width)
        self._consume(step.next_tokens, step.mtp_hidden, step.positions, step.valid(), ragged=step.mask is not None)

    def advance(self, step: TargetStep) -> None:
        """Commit the pairs a verify kept (with fixed shapes: all ``K + 1`` slots, the rejected ones invalid, fed at
        once; otherwise queued for the next :meth:`flush`)."""
        if self.fixed_shapes:
            span = self.kv.begin(step.num_valid, step.width)
            self._advance(step.next_tokens, step.mtp_hidden, step.positions, step.valid(), key=span)
            return
        self.pending.append(replace(step.committed(), features=None))

    def flush(self) -> None:
        """Feed the queued pairs to the head in one forward (nothing when none are queued)."""
        if not self.pending:
            return
        step = TargetStep.concat(self.pending)
        self.pending = []
        self.kv.begin(step.num_valid, step.width)
        self._consume(step.next_tokens, step.mtp_hidden, step.positions, step.valid(), ragged=step.mask is not None)

    def consume(self, next_tokens, target_hidden, positions=None, mask=None) -> torch.Tensor:
        """Feed ``n`` pairs eagerly and commit them; returns ``g`` ``[B, n, H]``. ``positions`` ``[B, n]`` (an int:
        the first position; ``None``: continue each row), ``mask`` ``[B, n]`` (1 = real pair; ``None``: all)."""
        self.flush()
        batch, width = next_tokens.shape
        if not self.kv.lengths_host or len(self.kv.lengths_host) != batch:
            self._begin_batch(batch, next_tokens.device)
        offsets = torch.arange(width, device=next_tokens.device)
        if positions is None or isinstance(positions, int):
            start = self.next_position[:, None] if positions is None else positions
            positions = (offsets + start).expand(batch, width)
        valid = torch.ones_like(next_tokens, dtype=torch.bool) if mask is None else mask.bool()
        self.kv.begin(None if mask is None else mask.sum(-1).tolist(), width)
        return self._consume(next_tokens, target_hidden, positions, valid, ragged=mask is not None)

    def _mask(self, positions: torch.Tensor, query_valid: torch.Tensor | None, dtype: torch.dtype):
        """Query j sees real entries at positions ``<=`` its own (the one rule: `draft_attention_masks`)."""
        key_valid = self.kv.key_valid()
        if "flash" in self.implementation and key_valid is None and query_valid is None:
            return None  # flash-attn's own causal mask is bottom-right aligned: the same visibility
        one_query = positions.shape[1] == 1 and query_valid is None and not self.fixed_shapes  # after every entry
        layout = AttentionLayout(
            query_positions=positions,
            key_positions=self.kv.key_positions(),
            key_blocks=torch.full_like(self.kv.key_positions(), -1),
            context_end=None if one_query else positions + 1,
            key_valid=key_valid,
            query_valid=query_valid,
        )
        return draft_attention_masks(layout, {"mtp": (False, None)}, self.implementation, dtype)["mtp"]

    def _consume(self, tokens, hidden, positions, valid, ragged: bool = True) -> torch.Tensor:
        """``S`` pairs of which ``valid`` ``[B, S]`` are real (``ragged``: some are not). Graph-safe at fixed S."""
        self.kv.prepare(valid, positions)
        mask = self._mask(positions, valid if ragged else None, self.last_hidden.dtype)
        g = self.head(tokens, hidden, positions, cache=self.kv, attention_mask=mask)  # [B, S, H]
        new_g, has_pair = _last_valid(g, valid)
        self.last_hidden.copy_(torch.where(has_pair[:, None], new_g.to(self.last_hidden.dtype), self.last_hidden))
        new_position = _last_valid(positions, valid)[0] + 1
        self.next_position.copy_(torch.where(has_pair, new_position, self.next_position))
        return g

    def predict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 logits ``[B, V]`` from the remembered ``g``, and ``g`` ``[B, H]`` itself (never one that consumed T1)."""
        self.flush()
        return self.head.logits(self.last_hidden), self.last_hidden

    @torch.no_grad()
    def propose(
        self,
        num_tokens: int,
        select: Select | None = None,
        more: Callable[[int], bool] | None = None,
        stage: Callable[[str], contextlib.AbstractContextManager] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP-k drafting as vLLM/SGLang do it: step 1 is :meth:`predict`; each later step feeds (previous draft,
        previous ``g``) at the next position. Returns ``(draft_ids [B, k], draft_logits [B, k, V])``; the chained
        entries are forgotten afterwards, so the committed state is unchanged. ``more(j)``, asked after j steps,
        may stop the chain early (adaptive MTP-k); ``stage(name)`` times step 1 as ``t1`` and the later ones as
        ``mtp_step`` (`SpecStats.stage`)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.flush()
        select = select or (lambda logits: logits.argmax(dim=-1))
        stage = stage or (lambda name: contextlib.nullcontext())
        # the last committed pair
        hidden = self.last_hidden  # [B, H]
        position = self.next_position - 1  # [B]
        with stage("t1"):
            logits = [self.head.logits(hidden)]
            tokens = [select(logits[-1])]
        saved = self.kv.save()
        try:
            for step in range(1, num_tokens):
                if more is not None and not more(step):
                    break
                with stage("mtp_step"):
                    positions = (position + step)[:, None]
                    self.kv.begin(None, 1)
                    self.kv.prepare(torch.ones_like(positions, dtype=torch.bool), positions)
                    mask = self._mask(positions, None, hidden.dtype)
                    hidden = self.head(
                        tokens[-1][:, None], hidden[:, None], positions, cache=self.kv, attention_mask=mask
                    )
                    hidden = hidden[:, 0]
                    logits.append(self.head.logits(hidden))
                    tokens.append(select(logits[-1]))
        finally:
            self.kv.restore(saved)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only batch ``rows`` (graphs are recaptured for the new batch size)."""
        self.kv.select_rows(rows, rows_host)
        self.pending = [step.select_rows(rows, rows_host) for step in self.pending]
        self.last_hidden = self.last_hidden.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)
        self._advance.reset()

    def graph_calls(self) -> list[CUDAGraphCall]:
        """The captured stages (their replay counts, capture times and failures)."""
        return [self._advance]

    def state(self) -> list[torch.Tensor]:
        """Tensors ``advance`` mutates besides K/V."""
        return [*self.kv.state(), self.last_hidden, self.next_position]


class DFlashContext:
    """The DFlash draft's context (see the module docstring): the block attends to every real context entry, so
    their order in the slots does not matter. The first block carries the prompt's features and runs eagerly."""

    def __init__(self, draft: DMTPDraftModel, fixed_shapes: bool = False, cuda_graphs: bool = False) -> None:
        self.draft = draft
        self.kv = SlotKV(fixed_shapes)
        self.fixed_shapes = fixed_shapes
        self.pending: list[TargetStep] = []
        self.implementation = draft.config._attn_implementation or "sdpa"
        self.kinds = layer_kinds(draft.layers)
        self._forward = CUDAGraphCall(self._block_forward, self.kv.state, enabled=cuda_graphs and fixed_shapes)
        self._prompt_block = False

    def start(self, step: TargetStep) -> None:
        """Empty slots for the batch (in place when its size is the previous call's: graphs stay valid); queue the
        prompt features."""
        if self.kv.reset(step.positions.shape[0], step.positions.device):
            self._forward.reset()
        self.pending = [step]
        self._prompt_block = True

    def add(self, step: TargetStep) -> None:
        """Queue the features of newly committed positions (fed to the draft with the next block)."""
        self.pending.append(step if self.fixed_shapes else step.committed())

    def block_outputs(
        self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over the block ``[B, Q, H]`` after writing the queued context: the final-normed hidden
        ``[B, n, H]`` and the draft logits ``[B, n, V]`` of the predicted slots."""
        new = TargetStep.concat(self.pending)
        self.pending = []
        span = self.kv.begin(new.num_valid, new.width)
        args = (block_embeds, anchor_positions, new.features, new.positions, new.valid())
        if self._prompt_block:  # the prompt's features: another shape, run eagerly
            self._prompt_block = False
            hidden = self._block_forward(*args)
        else:
            hidden = self._forward(*args, key=span)
        hidden = hidden[:, self.draft.config.first_predicted_slot :]
        return hidden, self.draft.compute_logits(hidden)

    def _block_forward(self, block_embeds, anchor_positions, features, positions, valid) -> torch.Tensor:
        """Write the context into the slots, then the block over ``[context slots | block]`` (graph-safe)."""
        self.kv.prepare(valid, positions)
        block_positions = self.draft.block_position_ids(anchor_positions)  # [B, Q]
        context_valid = self.kv.key_valid()
        key_valid = None
        if context_valid is not None:  # the block's own keys are always valid
            key_valid = torch.cat([context_valid, torch.ones_like(block_positions, dtype=torch.bool)], dim=1)
        layout = AttentionLayout(
            query_positions=block_positions,
            key_positions=torch.cat([self.kv.key_positions(), block_positions], dim=1),
            key_blocks=torch.cat([torch.full_like(self.kv.key_positions(), -1), torch.zeros_like(block_positions)], 1),
            key_valid=key_valid,
        )
        masks = draft_attention_masks(layout, self.kinds, self.implementation, block_embeds.dtype)
        return self.draft(
            block_embeds, features, torch.cat([positions, block_positions], dim=1), attention_mask=masks, cache=self.kv
        ).last_hidden_state

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only batch ``rows`` of the slots and of queued features (graphs are recaptured)."""
        self.kv.select_rows(rows, rows_host)
        self._forward.reset()
        self.pending = [step.select_rows(rows, rows_host) for step in self.pending]

    def graph_calls(self) -> list[CUDAGraphCall]:
        """The captured stages (their replay counts, capture times and failures)."""
        return [self._forward]
