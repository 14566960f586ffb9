"""CUDA graphs for decode batches.

Decode steps are captured once per batch-size bucket over the static buffers of
DecodeGraphInputs (graph_inputs.py, which also states the padding rule). At replay a
step of b rows is copied in (one copy) and runs in the smallest bucket B >= b.

What a graph holds is the whole step but the plan: resolving the futures in its input ids,
writing its table cells, the attention metadata, the forward, the greedy sample and storing
it as the next step's future. So a greedy step costs the host a buffer fill, one copy, one
plan and one replay (`decode`).

The attention backend takes part through four hooks (base.py): `graph_states` gives each
bucket the fixed index buffers its kernels read, `graph_decode_metadata` fills them inside
the graph, `plan_graph_decode` plans the kernels outside it before every replay, and
`use_graph_state` points the forward at a bucket's state while it is captured.

What a replay returns is a view of the graph's static output: it is overwritten
by the next replay of that bucket (ModelRunner.forward states the contract).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
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
        pool = runner.req_to_token_pool
        self.inputs = inputs = DecodeGraphInputs(self.max_bs, runner.device, pool.scratch_row)
        max_pages = -(-runner.max_context_len // runner.page_size)
        self.states = backend.graph_states(self.buckets, max_pages)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        future = runner.future_map.buf
        table = pool.req_to_token if pool.mirrored else None  # else the host's write was the table's
        capture = capture or CudaGraphs()
        model = runner.model
        empty = np.zeros(0, dtype=np.int64)

        def step(bs: int, batch: ForwardBatch, state: object) -> torch.Tensor:
            inputs.prologue(bs, future, table)
            backend.graph_decode_metadata(state, batch)
            logits = model(batch, backend)
            inputs.epilogue(bs, logits, future)
            return logits

        for bs in reversed(self.buckets):
            batch = inputs.fill(bs, empty, empty, empty, empty, None)  # all padding
            inputs.check_views(batch)
            backend.plan_graph_decode(self.states[bs], batch)
            backend.use_graph_state(self.states[bs])
            try:
                with torch.inference_mode():
                    self.graphs[bs], self.outputs[bs] = capture.capture(
                        lambda bs=bs, b=batch, st=self.states[bs]: step(bs, b, st))
            finally:
                backend.use_graph_state(None)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and self.fits(batch.batch_size)

    def fits(self, rows: int) -> bool:
        """A decode step of `rows` rows has a bucket."""
        return rows <= self.max_bs

    def decode(self, input_ids: np.ndarray, positions: np.ndarray, locs: np.ndarray, rows: np.ndarray,
               future_slots: range | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of b = len(rows) rows (host arrays; input ids may be futures): the logits
        and the greedy sample of each row, views of the graph's static outputs (valid until the
        next replay of the bucket). With `future_slots` the samples are also stored there."""
        b = len(rows)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        batch = self.inputs.fill(bs, input_ids, positions, locs, rows, future_slots)
        self._replay(bs, batch)
        if b not in self._views:  # views made once per size: slicing is a torch op each step
            self._views[b] = (self.outputs[bs][:b], self.inputs.next_ids[:b])
        return self._views[b]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """A ForwardBatch already built on the device (offline callers: runner/static_generate.py):
        its fields come back to the host first, which syncs; serving steps go through `decode`."""
        cpu = lambda t: t.to("cpu", torch.int64).numpy()  # noqa: E731
        return self.decode(cpu(batch.input_ids), cpu(batch.positions), cpu(batch.out_cache_loc),
                           cpu(batch.req_pool_indices), None)[0]

    def _replay(self, bs: int, batch: ForwardBatch) -> None:
        self.backend.plan_graph_decode(self.states[bs], batch)
        # A real replay runs the kernels captured with this state whatever is active; a capture
        # that re-runs the forward (the CPU tests') must see the same state.
        self.backend.use_graph_state(self.states[bs])
        try:
            self.graphs[bs].replay()
        finally:
            self.backend.use_graph_state(None)
