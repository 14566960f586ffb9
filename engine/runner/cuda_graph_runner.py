"""CUDA graphs for decode batches.

Decode forwards are captured once per batch-size bucket over the static buffers
of DecodeGraphInputs (graph_inputs.py, which also states the padding rule). At
replay a batch of b rows is copied in and runs in the smallest bucket B >= b.

The attention backend takes part through three hooks (base.py): `graph_states`
gives each bucket the fixed index buffers its kernels read, `plan_graph_decode`
refills them outside the graph before every replay, and `use_graph_state` points
the forward at a bucket's state while it is captured.

What a replay returns is a view of the graph's static output: it is overwritten
by the next replay of that bucket (ModelRunner.forward states the contract).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.runner.graph_inputs import DecodeGraphInputs


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_bs, and max_bs itself: at most 15 rows of padding."""
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class GraphCapture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Record `fn` once; return (graph with .replay(), the output tensor replays write)."""
        ...


class CudaGraphs:
    """Real capture: warm-up runs outside the graph, then one recorded run. All graphs share
    one memory pool; capturing the largest bucket first lets the smaller ones reuse its memory."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        for _ in range(2):  # first-call work (kernel selection, allocator growth) stays out of the graph
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class CudaGraphRunner:
    def __init__(self, runner: Any, max_bs: int, capture: GraphCapture | None = None) -> None:
        self.backend = backend = runner.attn_backend
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.inputs = DecodeGraphInputs(self.max_bs, runner.device)
        max_pages = -(-runner.max_context_len // runner.page_size)
        self.states = backend.graph_states(self.buckets, max_pages)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        capture = capture or CudaGraphs()
        model = runner.model
        for bs in reversed(self.buckets):
            batch = self.inputs.batch(bs, [0] * bs, [1] * bs)
            self.inputs.check_views(batch)
            backend.plan_graph_decode(self.states[bs], batch)
            backend.use_graph_state(self.states[bs])
            try:
                with torch.inference_mode():
                    self.graphs[bs], self.outputs[bs] = capture.capture(lambda b=batch: model(b, backend))
            finally:
                backend.use_graph_state(None)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        b = batch.batch_size
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        static = self.inputs.load(batch, bs)
        self.backend.plan_graph_decode(self.states[bs], static)
        # A real replay runs the kernels captured with this state whatever is active; a capture
        # that re-runs the forward (the CPU tests') must see the same state.
        self.backend.use_graph_state(self.states[bs])
        try:
            self.graphs[bs].replay()
        finally:
            self.backend.use_graph_state(None)
        return self.outputs[bs][:b]
