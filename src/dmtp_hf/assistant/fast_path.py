"""The fixed-shape fast path of a decoding round (DMTP blog §6): device-side slots and CUDA graphs.

The dynamic path (``drafters.py``) grows caches by concatenation and sizes every tensor to what the round
committed, which costs a host sync (``counts.max()``) and reallocations per round and cannot be captured in a CUDA
graph. The fast path keeps every drafter tensor at a fixed shape:

- :class:`SlotCache`: K/V buffers of fixed capacity per layer, written at per-row offsets that live on the device.
  A call writes a fixed number of slots ``S``; slot j of row b lands at ``lengths[b] + (rank of j among the row's
  valid slots)``, invalid slots go to one scratch column that no query ever sees. Validity is then simply
  ``index < lengths``, rolling back is ``lengths -= n`` and any batch size with ragged acceptance works.
- :class:`MTPSlots`: the native MTP head's private state on a :class:`SlotCache`; after each verify it consumes
  exactly ``K + 1`` slots (n accepted + bonus, the rest invalid), so advancing has one shape.
- :class:`StaticDFlashContext`: the DFlash draft's context K/V on a :class:`SlotCache`, with the block's visibility
  mask built on the device from the slot positions.
- :class:`CUDAGraphCall`: captures a fixed-shape function once per input signature (batch size) and replays it;
  on CPU (or when disabled) it simply calls the function, so the CPU tests exercise exactly the captured code.

Graphs are used for the greedy round without logits processors (the common serving case): MTP advance, T1 head +
argmax + embedding + fusion, and the DFlash block forward + draft LM head. Sampling or processors run the same
fixed-slot code eagerly. The target's verify forward stays eager (its caches belong to Transformers).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from ..modeling.modeling_dmtp import DMTPDraftModel, attention_mask_for_implementation, dflash_visibility
from .drafters import (
    DFlashDrafter,
    DMTPDrafter,
    MTPDrafter,
    Proposal,
    TargetStep,
    TokenSelector,
    _stage,
)
from .stats import SpecStats

FAR = 2**40  # position given to unwritten and scratch slots: never before any anchor, never in any window
DEFAULT_CAPACITY = 4096  # slots per row when the decoding loop did not call `reserve`


class SlotCache:
    """Fixed-capacity K/V slots for a few attention layers, duck-typing the ``Cache.update`` call of HF layers.

    ``capacity`` real entries per row plus one scratch column (index ``capacity``). Call :meth:`prepare` before each
    forward with the validity and positions of its ``S`` new slots; the layers' ``update`` calls then write there.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: torch.Tensor | None = None  # [B] committed entries per row
        self.positions: torch.Tensor | None = None  # [B, capacity + 1] position of each entry (FAR if none)
        self._write_index: torch.Tensor | None = None  # [B, S] where the forward in flight writes

    def reset(self, batch_size: int, device: torch.device) -> None:
        """Empty the cache for ``batch_size`` rows (buffers are allocated by the first ``update`` of each layer)."""
        self.keys, self.values = {}, {}
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.positions = torch.full((batch_size, self.capacity + 1), FAR, dtype=torch.long, device=device)

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


def _check_attention(implementation: str, what: str) -> None:
    if implementation not in ("sdpa", "eager"):
        raise NotImplementedError(
            f"The fixed-slot fast path builds dense masks for the {what}; its attention implementation is "
            f"{implementation!r}. Load it with attn_implementation='sdpa' (or 'eager')."
        )


class MTPSlots:
    """The native MTP head's round state on fixed slots (same API as the head: prefill/advance/predict/propose).

    ``g`` (the MTP hidden that predicts the next T1) and the next position are device buffers updated in place,
    so a captured ``advance`` keeps working across rounds.
    """

    def __init__(self, head, capacity: int) -> None:
        self.head = head
        self.cache = SlotCache(capacity)
        self.last_hidden: torch.Tensor | None = None  # [B, H]
        self.next_position: torch.Tensor | None = None  # [B]
        self.implementation = getattr(head.config, "_attn_implementation", None) or "sdpa"
        _check_attention(self.implementation, "native MTP layer")

    def _mask(self, positions: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Query j sees real entries at positions <= its own; invalid queries see everything (no all-masked rows,
        # hence no NaN; their outputs are discarded).
        keys = self.cache.visible_positions()[:, None, None, :]  # [B, 1, 1, C+1]
        visible = (keys <= positions[:, None, :, None]) | ~valid[:, None, :, None]
        return attention_mask_for_implementation(visible, self.implementation, dtype)

    def prefill(self, tokens, hidden, positions, valid=None) -> None:
        """Start the sequences of a batch with all prompt pairs (any length)."""
        batch = tokens.shape[0]
        self.cache.reset(batch, tokens.device)
        self.last_hidden = hidden.new_zeros(batch, hidden.shape[-1]).to(self.head.projection.weight.dtype)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        self.advance(tokens, hidden, positions, valid)

    def advance(self, tokens, hidden, positions, valid=None) -> None:
        """Consume ``S`` pairs ``(x_{t+1}, h_t)`` of which ``valid`` ``[B, S]`` are real (fixed S: graph-safe)."""
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        self.cache.prepare(valid, positions)
        mask = self._mask(positions, valid, self.last_hidden.dtype)
        g = self.head(tokens, hidden, positions, cache=self.cache, attention_mask=mask)  # [B, S, H]
        steps = torch.arange(tokens.shape[1], device=tokens.device)
        last = torch.where(valid, steps, -1).amax(dim=-1)  # [B] each row's last real pair
        index = last.clamp(min=0)
        new_g = g.gather(1, index[:, None, None].expand(-1, 1, g.shape[-1]))[:, 0]
        has_pair = last >= 0
        self.last_hidden.copy_(torch.where(has_pair[:, None], new_g.to(self.last_hidden.dtype), self.last_hidden))
        new_position = positions.gather(1, index[:, None])[:, 0] + 1
        self.next_position.copy_(torch.where(has_pair, new_position, self.next_position))

    def predict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """T1 logits ``[B, V]`` and the MTP hidden ``g`` ``[B, H]`` that predicts T1."""
        return self.head.logits(self.last_hidden), self.last_hidden

    def propose(
        self, num_tokens: int, select: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP-k chaining on the slots, as `NativeMTPHead.propose`: ``(draft_ids [B, k], draft_logits [B, k, V])``;
        the chained entries are rolled back (``lengths`` restored)."""
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

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows``."""
        self.cache.select_rows(rows)
        self.last_hidden = self.last_hidden.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)

    def state(self) -> list[torch.Tensor]:
        """Tensors ``advance`` mutates besides K/V."""
        return [*self.cache.state(), self.last_hidden, self.next_position]


class StaticDFlashContext:
    """The DFlash draft's context on fixed slots: same role as the dynamic ``_DFlashContext``.

    ``add`` queues the features of committed positions; ``run_block`` writes them into the slots and runs the block
    ``[A, (T1,) MASK ...]`` against every real context entry (strictly before the anchor) in one forward.
    """

    def __init__(self, draft: DMTPDraftModel, capacity: int) -> None:
        self.draft = draft
        self.cache = SlotCache(capacity)
        self.pending: list[TargetStep] = []
        self.implementation = draft.config._attn_implementation or "sdpa"
        _check_attention(self.implementation, "DFlash draft")
        attentions = {layer.self_attn.layer_type: layer.self_attn for layer in draft.layers}
        self.layer_kinds = {kind: (attn.block_causal, attn.sliding_window) for kind, attn in attentions.items()}

    def start(self, step: TargetStep) -> None:
        """Empty slots for the batch; queue the prompt features."""
        self.cache.reset(step.positions.shape[0], step.positions.device)
        self.pending = [step]

    def add(self, step: TargetStep) -> None:
        """Queue the features of newly committed positions."""
        self.pending.append(step)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queued ``(features [B, S, kH], positions [B, S], valid [B, S])``, concatenated, and clear the queue."""
        steps, self.pending = self.pending, []
        valid = [s.mask if s.mask is not None else torch.ones_like(s.positions, dtype=torch.bool) for s in steps]
        return (
            torch.cat([s.features for s in steps], dim=1),
            torch.cat([s.positions for s in steps], dim=1),
            torch.cat(valid, dim=1),
        )

    def run_block(
        self,
        block_embeds: torch.Tensor,  # [B, Q, H]
        anchor_positions: torch.Tensor,  # [B]
        features: torch.Tensor,  # [B, S, kH] new context features
        positions: torch.Tensor,  # [B, S]
        valid: torch.Tensor,  # [B, S]
    ) -> torch.Tensor:
        """Write the new context slots and run the block; returns the final-normed block hidden ``[B, Q, H]``."""
        self.cache.prepare(valid, positions)
        block_positions = self.draft.block_position_ids(anchor_positions)  # [B, Q]
        key_positions = torch.cat([self.cache.visible_positions(), block_positions], dim=1)[:, None, None, :]
        key_blocks = torch.cat([torch.full_like(self.cache.positions, -1), torch.zeros_like(block_positions)], dim=1)[
            :, None, None, :
        ]
        query_positions = block_positions[:, None, :, None]
        masks = {}
        for kind, (causal, window) in self.layer_kinds.items():
            visible = dflash_visibility(
                query_positions, 0, anchor_positions[:, None, None, None], key_positions, key_blocks,
                causal=causal, window=window,
            )  # fmt: skip
            masks[kind] = attention_mask_for_implementation(visible, self.implementation, block_embeds.dtype)
        return self.draft(
            block_embeds,
            features,
            torch.cat([positions, block_positions], dim=1),
            attention_mask=masks,
            cache=self.cache,
        ).last_hidden_state

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of the slots and of queued features."""
        self.cache.select_rows(rows)
        self.pending = [
            TargetStep(*(None if t is None else t[rows] for t in step.__dict__.values())) for step in self.pending
        ]


class CUDAGraphCall:
    """Call ``fn`` through CUDA graphs captured once per input signature (shapes and dtypes, e.g. per batch size).

    ``fn`` must take and return tensors of fixed shapes and mutate persistent state only in place; ``state()``
    lists the mutated tensors so the warm-up runs before capture can be undone. Replays copy the inputs into the
    captured buffers; the returned tensors are overwritten by the next replay. Without CUDA (or with
    ``enabled=False``) ``fn`` is simply called.
    """

    def __init__(
        self, fn: Callable[..., object], state: Callable[[], Sequence[torch.Tensor]], enabled: bool = True
    ) -> None:
        self.fn = fn
        self.state = state
        self.enabled = enabled
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}
        self.replays = 0

    def reset(self) -> None:
        """Drop every captured graph (after the state was reallocated, e.g. rows left the batch)."""
        self.graphs.clear()

    def __call__(self, *inputs: torch.Tensor):
        """``fn(*inputs)``: a graph replay on CUDA (captured on first use of this signature), else a plain call."""
        if not (self.enabled and inputs[0].is_cuda):
            return self.fn(*inputs)
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(inputs)
            except RuntimeError as err:  # an op that cannot be captured (host sync, dynamic shape): stay eager
                warnings.warn(f"CUDA graph capture failed, running eagerly: {err}", RuntimeWarning, stacklevel=2)
                self.enabled = False
                return self.fn(*inputs)
            self.graphs[key] = entry
        graph, static_inputs, outputs = entry
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        self.replays += 1
        return outputs

    def _capture(self, inputs: Sequence[torch.Tensor]):
        static_inputs = [t.clone() for t in inputs]
        saved = [t.clone() for t in self.state()]

        def restore() -> None:
            for tensor, value in zip(self.state(), saved):
                tensor.copy_(value)

        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy allocations, cuBLAS handles, autotuning
                    self.fn(*static_inputs)
                    restore()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.fn(*static_inputs)
        finally:
            restore()  # the state is as before the call whatever happened (capture itself runs no kernel)
        return graph, static_inputs, outputs


# ---------------------------------------------------------------------------------------------------------------
# Drafters on the fast path: same proposals as their dynamic counterparts (tests check token equality).


def _is_greedy(select: TokenSelector) -> bool:
    return not select.logits_processor and not select.do_sample


class _FixedSlots:
    """What every fast-path drafter shares: fixed-slot advancing and slot capacity sized by `reserve`."""

    fixed_slots = True
    capacity = DEFAULT_CAPACITY
    num_candidates: int

    def reserve(self, max_positions: int) -> None:
        """Size the slots for sequences of up to ``max_positions`` tokens."""
        self.capacity = max_positions + self.num_candidates + 1


class FastMTPDrafter(_FixedSlots, MTPDrafter):
    """Native MTP-k with the head's state on fixed slots (`MTPSlots`); ``advance`` is one captured graph on CUDA."""

    def __init__(self, mtp_head, num_steps: int = 1, *, cuda_graphs: bool = True) -> None:
        super().__init__(mtp_head, num_steps)
        self.cuda_graphs = cuda_graphs

    def start(self, step: TargetStep) -> None:
        """Prefill fresh slots over the prompt pairs."""
        self.state = MTPSlots(self.mtp, self.capacity)
        super().start(step)
        self._advance = CUDAGraphCall(self.state.advance, self.state.state, self.cuda_graphs)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Consume the verify's ``K + 1`` slots (accepted + bonus valid, the rest scratch)."""
        with _stage(stats, "mtp"), torch.no_grad():
            self._advance(step.next_tokens, step.mtp_hidden, step.positions, step.mask)

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows; graphs are recaptured for the new batch size."""
        super().select_rows(rows)
        self._advance = CUDAGraphCall(self.state.advance, self.state.state, self.cuda_graphs)
        return True


class FastDMTPDrafter(_FixedSlots, DMTPDrafter):
    """DMTP on the fast path: MTP advance, T1 head + embedding + fusion, and the DFlash block each one graph."""

    def __init__(self, draft: DMTPDraftModel, mtp_head, *, cuda_graphs: bool = True) -> None:
        super().__init__(draft, mtp_head)
        self.cuda_graphs = cuda_graphs
        self.slots: MTPSlots | None = None
        self.static_context: StaticDFlashContext | None = None

    def start(self, step: TargetStep) -> None:
        """Prefill the MTP slots over the prompt pairs; queue the prompt features for the first block."""
        self.slots = MTPSlots(self.mtp, self.capacity)
        self.static_context = StaticDFlashContext(self.draft, self.capacity)
        self.static_context.start(step)
        with torch.no_grad():
            self.slots.prefill(step.next_tokens, step.mtp_hidden, step.positions, step.mask)
        self._make_graphs()

    def _make_graphs(self) -> None:
        self._advance = CUDAGraphCall(self.slots.advance, self.slots.state, self.cuda_graphs)
        self._t1_block = CUDAGraphCall(self._t1_block_eager, lambda: [], self.cuda_graphs)
        self._draft_block = CUDAGraphCall(self._draft_block_eager, self.static_context.cache.state, self.cuda_graphs)

    def _t1_block_eager(self, anchor_ids: torch.Tensor):
        # Greedy T1 from the cached MTP hidden, then the block slots [E(A), fuse(E(T1), g), E(MASK) ...].
        t1_logits, mtp_hidden = self.slots.predict()
        t1 = t1_logits.argmax(dim=-1)
        return t1, t1_logits, self.draft.block_embeddings(anchor_ids, t1, mtp_hidden)

    def _draft_block_eager(self, block, anchor_positions, features, positions, valid):
        hidden = self.static_context.run_block(block, anchor_positions, features, positions, valid)
        logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
        return logits.argmax(dim=-1), logits

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """T1 from the cached MTP hidden, fusion, one DFlash forward for T2..T7 (graphs when greedy)."""
        greedy = _is_greedy(select)
        features, positions, valid = self.static_context.take_pending()
        with stats.stage("t1_fusion"):
            if greedy:
                t1, t1_logits, block = self._t1_block(prefix[:, -1])
                t1, t1_scores = t1[:, None].clone(), t1_logits[:, None].float()
            else:
                t1_logits, mtp_hidden = self.slots.predict()
                t1, t1_scores = select(t1_logits[:, None], prefix)
                block = self.draft.block_embeddings(prefix[:, -1], t1[:, 0], mtp_hidden)
        with stats.stage("dflash"):
            if greedy:
                # The prompt's first block has the prompt's width: run it eagerly rather than capture it.
                run = self._draft_block if features.shape[1] == self.num_candidates + 1 else self._draft_block_eager
                rest, logits = run(block, anchor_positions, features, positions, valid)
                rest, rest_scores = rest.clone(), logits.float()
            else:
                hidden = self.static_context.run_block(block, anchor_positions, features, positions, valid)
                logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
                rest, rest_scores = select(logits, torch.cat([prefix, t1], dim=1))
        return Proposal(torch.cat([t1, rest], dim=1), torch.cat([t1_scores, rest_scores], dim=1))

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Queue the committed features; consume the verify's ``K + 1`` MTP slots."""
        self.static_context.add(step)
        with _stage(stats, "mtp"), torch.no_grad():
            self._advance(step.next_tokens, step.mtp_hidden, step.positions, step.mask)

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows; graphs are recaptured for the new batch size."""
        self.slots.select_rows(rows)
        self.static_context.select_rows(rows)
        self._make_graphs()
        return True


class FastDFlashDrafter(_FixedSlots, DFlashDrafter):
    """DFlash alone on the fast path: the block forward is one graph."""

    def __init__(self, draft: DMTPDraftModel, *, cuda_graphs: bool = True) -> None:
        super().__init__(draft)
        self.cuda_graphs = cuda_graphs
        self.static_context: StaticDFlashContext | None = None

    def start(self, step: TargetStep) -> None:
        """Empty slots; queue the prompt features."""
        self.static_context = StaticDFlashContext(self.draft, self.capacity)
        self.static_context.start(step)
        self._draft_block = CUDAGraphCall(self._draft_block_eager, self.static_context.cache.state, self.cuda_graphs)

    def _draft_block_eager(self, anchor_ids, anchor_positions, features, positions, valid):
        block = self.draft.block_embeddings(anchor_ids)
        hidden = self.static_context.run_block(block, anchor_positions, features, positions, valid)
        logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
        return logits.argmax(dim=-1), logits

    def propose(
        self, prefix: torch.Tensor, anchor_positions: torch.Tensor, select: TokenSelector, stats: SpecStats
    ) -> Proposal:
        """``[A, MASK x K]`` -> K candidates."""
        features, positions, valid = self.static_context.take_pending()
        with stats.stage("dflash"):
            if _is_greedy(select):
                run = self._draft_block if features.shape[1] == self.num_candidates + 1 else self._draft_block_eager
                tokens, logits = run(prefix[:, -1], anchor_positions, features, positions, valid)
                return Proposal(tokens.clone(), logits.float())
            block = self.draft.block_embeddings(prefix[:, -1])
            hidden = self.static_context.run_block(block, anchor_positions, features, positions, valid)
            logits = self.draft.compute_logits(hidden[:, self.draft.config.first_predicted_slot :])
            tokens, scores = select(logits, prefix)
        return Proposal(tokens, scores)

    def advance(self, step: TargetStep, stats: SpecStats | None = None) -> None:
        """Queue the committed features."""
        self.static_context.add(step)

    def select_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished rows; the graph is recaptured for the new batch size."""
        self.static_context.select_rows(rows)
        self._draft_block = CUDAGraphCall(self._draft_block_eager, self.static_context.cache.state, self.cuda_graphs)
        return True
