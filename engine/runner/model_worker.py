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

import torch

from tandem.engine.device_map import bind_device
from tandem.engine.forward_batch import ForwardBatch
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
        self, mwb: ModelWorkerBatch, future_map: FutureMap | None = None, future_idx: torch.Tensor | None = None
    ) -> GenerationBatchResult:
        start = time.perf_counter()
        dev = self.runner.device
        input_ids = mwb.input_ids.to(dev, non_blocking=True)
        if future_map is not None:
            input_ids = future_map.resolve(input_ids)
        fb = ForwardBatch.build(
            mwb.mode, input_ids, mwb.req_pool_indices, mwb.prefix_lens, mwb.extend_lens,
            mwb.out_cache_loc, dev, num_extend_reqs=mwb.num_extend_reqs,
        )
        logits = self.runner.forward(fb)
        if mwb.grammar is not None:
            mwb.grammar.apply(logits)  # under overlap: waits until batch N-1 is processed
        sb = SamplingBatch.from_params(mwb.sampling_params, self.runner.vocab_size, dev)
        positions = torch.tensor(mwb.sample_positions, dtype=torch.int64).to(dev, non_blocking=True)
        out = self.runner.sample(logits, sb, positions)
        if future_map is not None and future_idx is not None:
            future_map.store(future_idx, out.next_token_ids)
        copy_done = None
        if dev.type == "cuda":
            out = SampleOutput(*(t.to("cpu", non_blocking=True) if t is not None else None for t in (
                out.next_token_ids, out.logprobs, out.top_logprobs, out.top_ids)))
            copy_done = torch.cuda.Event()
            copy_done.record()
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

    def launch(self, mwb: ModelWorkerBatch) -> tuple[Future, torch.Tensor]:
        """Queue the forward; return its future result and the batch's future ids (negative)."""
        idx = self.future_map.alloc(len(mwb.req_pool_indices))
        fut: Future = Future()
        self._jobs.put((mwb, idx, fut, self.handoff.mark()))
        return fut, -idx

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
                mwb, idx, fut, ready = job
                try:
                    self.handoff.wait(ready)
                    fut.set_result(self.worker.forward_batch_generation(mwb, self.future_map, idx))
                except BaseException as exc:  # surfaced to the scheduler at .result()
                    fut.set_exception(exc)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
