"""Replay a fixed-shape stage of a round as a CUDA graph: a wrapper around the stage, not a subclass of anything.

Used by the fixed-slot drafter state (``state.py``) for MTP advance and the DFlash block forward. On CPU,
or with ``enabled=False``, the wrapped function is simply called, so CPU tests run exactly the captured code.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable, Sequence

import torch


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
        self.captures = 0
        self.capture_seconds = 0.0  # reported apart from every stage time and tokens/s figure
        self.failure: str | None = None  # why capture failed (the call then runs eagerly, and says so)

    def reset(self) -> None:
        """Drop every captured graph (after the state was reallocated, e.g. rows left the batch)."""
        self.graphs.clear()

    def __call__(self, *inputs: torch.Tensor, key: Hashable = None):
        """``fn(*inputs)``: a graph replay on CUDA (captured on first use of this signature: the inputs' shapes and
        dtypes plus ``key``, e.g. the attention span the call reads), else a plain call."""
        if not (self.enabled and inputs[0].is_cuda):
            return self.fn(*inputs)
        key = (tuple((tuple(t.shape), t.dtype) for t in inputs), key)
        entry = self.graphs.get(key)
        if entry is None:
            started = time.perf_counter()
            try:
                entry = self._capture(inputs)
            except RuntimeError as err:  # an op that cannot be captured (host sync, dynamic shape): stay eager
                # once per stage (the stage stays eager afterwards); spec_stats.cuda_graphs reports it too
                warnings.warn(f"CUDA graph capture failed, running eagerly: {err}", RuntimeWarning, stacklevel=2)
                self.enabled = False
                self.failure = str(err)
                return self.fn(*inputs)
            self.capture_seconds += time.perf_counter() - started
            self.captures += 1
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
            # Its own memory pool: a pool shared between stages is only safe while each graph's outputs are consumed
            # before another graph replays, which nothing here could check.
            with torch.cuda.graph(graph):
                outputs = self.fn(*static_inputs)
        finally:
            restore()  # the state is as before the call whatever happened (capture itself runs no kernel)
        return graph, static_inputs, outputs
