"""ModelWorker: ModelWorkerBatch -> ForwardBatch -> forward -> sampled ids.

`OverlapWorker` runs the same work on a dedicated thread so the scheduler can
prepare batch N+1 and process batch N-1 while batch N computes. torch releases
the GIL inside its kernels, so on CPU the forward really runs beside the
scheduler; on CUDA the thread also gives the forward its own stream.
Batches execute in launch order, which is what makes futures safe: batch N+1
resolves N's tokens only after N has stored them.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.engine.device_map import bind_device
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.runner.future_map import FutureMap
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.sampler import SampleOutput, SamplingBatch
from tandem.engine.worker_batch import ModelWorkerBatch


@dataclass
class GenerationBatchResult:
    """Sampled ids on the host. On CUDA the device->host copy is non-blocking and
    `copy_done` marks its end, so the forward thread never waits for the GPU."""

    out: SampleOutput
    want_logprobs: bool
    copy_done: object = None  # torch.cuda.Event on CUDA
    forward_start: float = 0.0  # perf_counter() stamps, for the idle-gap metric
    forward_end: float = 0.0
    next_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def materialize(self) -> GenerationBatchResult:
        if self.copy_done is not None:
            self.copy_done.synchronize()  # type: ignore[attr-defined]
        out = self.out
        self.next_token_ids = out.next_token_ids.tolist()
        if self.want_logprobs and out.logprobs is not None:
            self.logprobs = out.logprobs.tolist()
            if out.top_ids is not None and out.top_logprobs is not None:
                ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
                self.top_logprobs = [list(zip(i, lp)) for i, lp in zip(ids, lps)]
        return self


class ModelWorker:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def forward_batch_generation(
        self, mwb: ModelWorkerBatch, future_map: FutureMap | None = None, future_slots: range | None = None
    ) -> GenerationBatchResult:
        start = time.perf_counter()
        graphs = self.runner.graph_runner
        if mwb.mode == ForwardMode.DECODE and graphs is not None and graphs.fits(len(mwb.req_pool_indices)):
            out = self._graph_decode(mwb, graphs, future_map, future_slots)
        else:
            out = self._forward(mwb, future_map, future_slots)
        return self._to_host(out, mwb, start)

    def _graph_decode(self, mwb: ModelWorkerBatch, graphs: Any, future_map: FutureMap | None,
                      future_slots: range | None) -> SampleOutput:
        """A decode step as one replay: its futures resolved, its greedy samples taken and stored
        inside the graph (runner/graph_inputs.py). Other sampling runs on the logits after it."""
        if mwb.kv_ready is not None:  # the graph cannot wait layer by layer: all of them first
            mwb.kv_ready.wait(mwb.kv_ready.layers - 1)
        logits, greedy = graphs.decode(mwb.input_ids, np.asarray(mwb.prefix_lens, dtype=np.int64),
                                       mwb.out_cache_loc, np.asarray(mwb.req_pool_indices, dtype=np.int64),
                                       future_slots if future_map is not None else None)
        sb = SamplingBatch.from_params(mwb.sampling_params, self.runner.vocab_size, self.runner.device)
        if mwb.grammar is None and sb.all_greedy and not sb.return_logprob and not sb.top_logprobs_num:
            return SampleOutput(greedy)
        return self._sample(mwb, logits, sb, future_map, future_slots)

    def _forward(self, mwb: ModelWorkerBatch, future_map: FutureMap | None,
                 future_slots: range | None) -> SampleOutput:
        dev = self.runner.device
        input_ids = torch.from_numpy(mwb.input_ids).to(dev, non_blocking=True)
        if future_map is not None:
            input_ids = future_map.resolve(input_ids)
        fb = ForwardBatch.build(
            mwb.mode, input_ids, mwb.req_pool_indices, mwb.prefix_lens, mwb.extend_lens,
            torch.from_numpy(mwb.out_cache_loc), dev, num_extend_reqs=mwb.num_extend_reqs,
        )
        fb.kv_ready = mwb.kv_ready
        logits = self.runner.forward(fb)
        sb = SamplingBatch.from_params(mwb.sampling_params, self.runner.vocab_size, dev)
        return self._sample(mwb, logits, sb, future_map, future_slots)

    def _sample(self, mwb: ModelWorkerBatch, logits: torch.Tensor, sb: SamplingBatch,
                future_map: FutureMap | None, future_slots: range | None) -> SampleOutput:
        if mwb.grammar is not None:
            mwb.grammar.apply(logits)  # under overlap: waits until batch N-1 is processed
        dev = self.runner.device
        positions = torch.tensor(mwb.sample_positions, dtype=torch.int64).to(dev, non_blocking=True)
        out = self.runner.sample(logits, sb, positions)
        if future_map is not None and future_slots is not None:
            future_map.store(future_slots, out.next_token_ids)
        return out

    def _to_host(self, out: SampleOutput, mwb: ModelWorkerBatch, start: float) -> GenerationBatchResult:
        """The step's only device-to-host copy: the sampled ids (and logprobs when asked), behind an
        event on CUDA. The ids may be a view of a graph's static output, which the next replay
        overwrites: on CPU they are copied too, before the overlap loop launches that replay."""
        copy_done = None
        if self.runner.device.type == "cuda":
            out = SampleOutput(*(t.to("cpu", non_blocking=True) if t is not None else None for t in (
                out.next_token_ids, out.logprobs, out.top_logprobs, out.top_ids)))
            copy_done = torch.cuda.Event()
            copy_done.record()
        elif self.runner.graph_runner is not None:
            out.next_token_ids = out.next_token_ids.clone()
        return GenerationBatchResult(out, mwb.return_logprob, copy_done, start, time.perf_counter())


class StreamHandoff:
    """Orders the scheduler thread's device writes before the forward that reads them.

    The scheduler writes req_to_token (and frees/fills pool rows) on its thread's stream;
    the forward runs on the forward thread's own stream and reads them. CUDA orders work
    only within a stream, so `mark` (scheduler thread, at launch) records an event after
    those writes and `wait` (forward thread) makes the forward stream wait for it. On CPU
    both are no-ops: every op has finished when it returns."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, token: object) -> None:
        if token is not None:
            torch.cuda.current_stream().wait_event(token)  # type: ignore[arg-type]


class OverlapWorker:
    """A single forward thread fed in order; `launch` returns immediately."""

    def __init__(self, worker: ModelWorker, future_map: FutureMap, handoff: StreamHandoff | None = None) -> None:
        self.worker = worker
        self.future_map = future_map
        self.handoff = handoff or StreamHandoff(worker.runner.device)
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tandem-forward", daemon=True)
        self._stream = torch.cuda.Stream() if worker.runner.device.type == "cuda" else None
        self._thread.start()

    def launch(self, mwb: ModelWorkerBatch) -> tuple[Future, np.ndarray]:
        """Queue the forward; return its future result and the batch's future ids (negative)."""
        slots = self.future_map.alloc(len(mwb.req_pool_indices))
        fut: Future = Future()
        self._jobs.put((mwb, slots, fut, self.handoff.mark()))
        return fut, self.future_map.ids(slots)

    def _run(self) -> None:
        bind_device(self.worker.runner.device)
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        with torch.inference_mode():
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                mwb, slots, fut, ready = job
                try:
                    self.handoff.wait(ready)
                    fut.set_result(self.worker.forward_batch_generation(mwb, self.future_map, slots))
                except BaseException as exc:  # surfaced to the scheduler at .result()
                    fut.set_exception(exc)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
