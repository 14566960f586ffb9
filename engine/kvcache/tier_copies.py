"""TierCopies: the one queue every copy between the KV tiers goes through, run off the
scheduler's thread and layer by layer, so that a forward starts on layer 0 while later layers
still load (SGLang's HiCache does the same with a layer-done counter).

    scheduler thread                           copier (a thread on CPU, a copy stream on CUDA)
    evict / match_and_load / spill --queue-->  pending ops
    a batch launches (record_step) --launch->  one job: for each layer l, every op's part of
                                               layer l, then "layer l done"
    forward, layer l:  ready.wait(l)  <--------'  (before it stores or reads layer l's KV)

Why one queue, run in order and layer-major within a job: it orders every copy against every
other without tracking pages. A device page evicted (its write to the host queued) and handed at
once to a load, or a host page dropped and taken again by a later write, is read before it is
overwritten, because the op that reads it was queued first and runs first in every layer.

What is outside the queue must wait for it:
- The forward that launches with a job waits for layer l of it before touching layer l's KV: that
  covers the loads it reads and the writes still reading pages it is about to overwrite.
- A caller that hands device pages to anything else (PD decode gives a room's pages to the
  transfer) calls `drain()` first. So do reset, the integrity check and close.

On CPU the copies are numpy slice assignments (they let go of the GIL and stay on one thread, not
torch's intra-op pool); on CUDA they are asynchronous copies on a side stream from pinned host
memory, and waiting is the forward stream waiting on the layer's event, not the host.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.kvcache.page_copy import MAX_RUN_COPIES  # the same rule as the PD roles' page copies
from tandem.protocol.kv_layout import page_runs

IDLE_EXIT_S = 5.0  # the CPU copier's thread ends after this long with nothing to do; launch restarts it


@dataclass
class CopyOp:
    """dst[:, :, dst_pages[i]] = src[:, :, src_pages[i]]; both (layers, 2, pages, bytes) uint8."""

    src: torch.Tensor
    src_pages: Sequence[int]
    dst: torch.Tensor
    dst_pages: Sequence[int]
    kind: str  # "write" (device -> host), "load" (-> device), "spill" (-> a staging buffer)
    then: Callable[[], None] | None = None  # runs once every layer is copied (on the copier)


class CopyJob:
    """What one launch ran; a forward waits on it layer by layer."""

    layers: int

    def wait(self, layer: int) -> None:
        """Return once layer `layer` of every op is copied (on CUDA: once the caller's stream
        waits for it); raises if a copy failed."""
        raise NotImplementedError

    def wait_all(self) -> None:
        self.wait(self.layers - 1)

    def done(self) -> bool:
        raise NotImplementedError


class ThreadJob(CopyJob):
    def __init__(self, layers: int, stall: Callable[[float], None]) -> None:
        self.layers = layers
        self._done = 0  # layers copied
        self._finished = False  # and every op's `then` run
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._stall = stall

    def wait(self, layer: int) -> None:
        self._wait(lambda: self._done > layer, stall=True)

    def wait_all(self) -> None:
        self._wait(lambda: self._finished, stall=False)

    def _wait(self, ready: Callable[[], bool], stall: bool) -> None:
        with self._cond:
            if not ready() and self._error is None:
                t = time.perf_counter()
                while not ready() and self._error is None:
                    self._cond.wait()
                if stall:
                    self._stall(time.perf_counter() - t)
            if self._error is not None:
                raise RuntimeError(f"a KV tier copy failed: {self._error!r}") from self._error

    def done(self) -> bool:
        with self._cond:
            return self._finished or self._error is not None

    def layer_done(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()


class StreamJob(CopyJob):
    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.events = [torch.cuda.Event() for _ in range(layers)]

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        self.events[-1].synchronize()  # the host too: its callers hand the pages on

    def done(self) -> bool:
        return self.events[-1].query()


class TierCopies:
    """The queue. `add` from the scheduler's thread; `launch` when a batch launches; `drain`
    before handing device pages elsewhere. Subclasses run a job: a thread (CPU), a stream (CUDA)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._pending: list[CopyOp] = []
        self._last: CopyJob | None = None
        self.seconds = {"write": 0.0, "load": 0.0, "spill": 0.0}  # copier time per kind (CPU)
        self.stall_seconds = 0.0  # forwards waited this long for a layer (CPU; on CUDA the GPU waits)

    def add(self, op: CopyOp) -> None:
        self._pending.append(op)

    def launch(self) -> CopyJob | None:
        """Start what is queued as one job; the job a forward launched now must wait on (the last
        one while it runs: waiting on it waits on every job before it), or None."""
        self._poll()
        if self._pending:  # returned even if done already: a failed copy fails its forward
            self._last = self._start(self._take())
            return self._last
        if self._last is not None and self._last.done():
            self._last = None
        return self._last

    def drain(self) -> None:
        """Every queued copy done (and its `then` run); raises if one failed."""
        if self._pending:
            self._last = self._start(self._take())
        if self._last is not None:
            self._last.wait_all()
            self._last = None
        self._poll(block=True)

    def close(self) -> None:
        self.drain()

    def _take(self) -> list[CopyOp]:
        ops, self._pending = self._pending, []
        return ops

    def _start(self, ops: list[CopyOp]) -> CopyJob:
        raise NotImplementedError

    def _poll(self, block: bool = False) -> None:
        """Run the `then` of finished jobs where the copier cannot (CUDA); nothing on CPU."""


class ThreadCopies(TierCopies):
    """CPU: a thread runs the jobs in order; copies are numpy views of the pools' bytes."""

    def __init__(self, layers: int) -> None:
        super().__init__(layers)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open = 0  # jobs launched and not finished: the thread may not exit while any are

    def _start(self, ops: list[CopyOp]) -> CopyJob:
        job = ThreadJob(self.layers, self._add_stall)
        with self._lock:
            self._open += 1
            self._queue.put((job, ops))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-tier-copies", daemon=True)
                self._thread.start()
        return job

    def _add_stall(self, seconds: float) -> None:
        self.stall_seconds += seconds

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                item = None
            if item is None:  # idle, or closing
                with self._lock:
                    if self._open == 0:
                        self._thread = None
                        return
                continue
            job, ops = item
            try:
                self._run_job(job, ops)
            except BaseException as exc:  # a bug: surfaced to whoever waits on the job
                job.fail(exc)
            finally:
                with self._lock:
                    self._open -= 1

    def _run_job(self, job: ThreadJob, ops: list[CopyOp]) -> None:
        views = [(op.src.numpy(), op.dst.numpy(), page_runs(op.src_pages, op.dst_pages), op) for op in ops]
        for layer in range(self.layers):
            self._copy_layer(layer, views)
            job.layer_done()
        for op in ops:
            if op.then is not None:
                op.then()
        job.finish()

    def _copy_layer(self, layer: int, views: list[tuple[np.ndarray, np.ndarray, list, CopyOp]]) -> None:
        for src, dst, runs, op in views:
            t = time.perf_counter()
            if len(runs) <= MAX_RUN_COPIES:
                for s, d, n in runs:
                    dst[layer, :, d : d + n] = src[layer, :, s : s + n]
            else:
                dst[layer][:, list(op.dst_pages)] = src[layer][:, list(op.src_pages)]
            self.seconds[op.kind] += time.perf_counter() - t

    def close(self) -> None:
        self.drain()
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join(timeout=IDLE_EXIT_S + 1)


class StreamCopies(TierCopies):
    """CUDA: a job is queued on a side stream at once, an event after each layer; a forward's
    stream waits on the event (the host does not). `then` runs when a later launch finds the
    job's last event reached."""

    def __init__(self, layers: int, device: torch.device) -> None:
        super().__init__(layers)
        self.stream = torch.cuda.Stream(device)
        self._finishing: list[tuple[StreamJob, list[Callable[[], None]]]] = []

    def _start(self, ops: list[CopyOp]) -> CopyJob:
        job = StreamJob(self.layers)
        self.stream.wait_stream(torch.cuda.current_stream())  # whatever this thread queued before
        with torch.cuda.stream(self.stream):
            for layer in range(self.layers):
                for op in ops:
                    for s, d, n in page_runs(op.src_pages, op.dst_pages):
                        for kv in (0, 1):  # [layer, kv, run] is contiguous: one DMA, no staging copy
                            op.dst[layer, kv, d : d + n].copy_(op.src[layer, kv, s : s + n], non_blocking=True)
                job.events[layer].record(self.stream)
        self._finishing.append((job, [op.then for op in ops if op.then is not None]))
        return job

    def _poll(self, block: bool = False) -> None:
        still = []
        for job, thens in self._finishing:
            if block:
                job.wait_all()
            if job.done():
                for then in thens:
                    then()
            else:
                still.append((job, thens))
        self._finishing = still


def tier_copies(layers: int, device: torch.device) -> TierCopies:
    return StreamCopies(layers, device) if device.type == "cuda" else ThreadCopies(layers)


def staging(layers: int, pages: int, page_bytes_per_layer: int, pinned: bool) -> torch.Tensor:
    """A (layers, 2, pages, bytes) buffer for pages on their way to or from the disk tier."""
    return torch.empty((layers, 2, pages, page_bytes_per_layer), dtype=torch.uint8, pin_memory=pinned)


def from_payloads(payloads: Sequence[bytes], layers: int, pinned: bool) -> torch.Tensor:
    """Page payloads (each a page of every layer's K and V) as one staging buffer."""
    arr = np.stack([np.frombuffer(p, dtype=np.uint8).reshape(layers, 2, -1) for p in payloads], axis=2)
    out = torch.from_numpy(arr)
    return out.pin_memory() if pinned else out
