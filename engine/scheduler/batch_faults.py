"""A failing request fails alone: an exception in one batch fails that batch's requests, and
the scheduler goes on with the rest.

The loop's stages, and whom a failure in each is traced to:

    build    get_next_batch_to_run        the requests the batch was built from (BatchFailed,
             get_model_worker_batch       raised by the ScheduleBatch methods marked @traced)
    run      forward + sample             the batch's requests (under overlap, through its future)
    process  process_batch_result         the batch's requests

A failed request finishes with an abort (HTTP 500 before its first token) and its KV is
discarded, never cached: the forward that raised may have left its new KV half written, and
the prefix cache would hand that to the next request with the same prefix.

Some faults leave the device or the pools in an unknown state (`is_fatal`): a CUDA error, an
out-of-memory, a failed integrity assertion, a failure of the scheduler's own bookkeeping that
no batch can be named for. Those are not contained: they end the scheduler, its worker exits,
and Kubernetes or `tandem up --restart` replaces it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tandem.engine.scheduler.cache_manager import OutOfKV
from tandem.engine.scheduler.req import Req, finish_abort

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

T = TypeVar("T")
# Device faults that torch reports as a plain RuntimeError (older builds, NCCL, cuBLAS).
_DEVICE_WORDS = ("CUDA", "CUBLAS", "CUDNN", "NCCL", "DEVICE-SIDE ASSERT")


class BatchFailed(Exception):
    """Building a batch failed; `reqs` are the requests it was being built from."""

    def __init__(self, reqs: list[Req], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.reqs, self.cause = reqs, cause


def is_fatal(exc: BaseException) -> bool:
    """The fault may have left the device or the pools in a state no one knows."""
    if not isinstance(exc, Exception) or isinstance(exc, (MemoryError, AssertionError, OutOfKV)):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).upper() for w in _DEVICE_WORDS)


def traced(method: Callable[..., T]) -> Callable[..., T]:
    """For a ScheduleBatch method: a contained failure names the batch's requests, and those of
    a batch passed in (mix_with_running prepares the running batch and takes its requests)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kw: Any) -> T:
        # The membership before the call, by reference: ScheduleBatch replaces its `reqs` list and
        # never edits it in place, so nothing is copied on the hot path; lists are joined on failure only.
        before = [self.reqs, *(a.reqs for a in args if isinstance(getattr(a, "reqs", None), list))]
        try:
            return method(self, *args, **kw)
        except BatchFailed as exc:
            reqs = [r for group in before for r in group]
            raise BatchFailed(reqs + [r for r in exc.reqs if r not in reqs], exc.cause) from exc.cause
        except Exception as exc:
            if is_fatal(exc):
                raise
            raise BatchFailed([r for group in before for r in group], exc) from exc

    return wrapper


class BatchFaults:
    """The scheduler's containment of batch failures (see the module docstring)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.failed_batches = 0

    def build(self, make: Callable[[], T]) -> T | None:
        """make() builds a batch; when that fails, the requests it names fail and this gives None."""
        try:
            return make()
        except BatchFailed as exc:
            self.fail(exc.reqs, exc.cause)
            return None

    @contextlib.contextmanager
    def contain(self, reqs: list[Req]) -> Iterator[None]:
        """Running or processing the batch of `reqs`: a failure that is not fatal fails them."""
        try:
            yield
        except Exception as exc:
            if is_fatal(exc):
                raise
            self.fail(reqs, exc)

    def fail(self, reqs: list[Req], exc: Exception) -> None:
        s = self.sched
        self.failed_batches += 1
        log.error("a batch of %d request(s) failed; failing them alone", len(reqs), exc_info=exc)
        reason = finish_abort(f"the engine failed on this request's batch: {type(exc).__name__}: {exc}", 500)
        # Requests not settled yet: unfinished ones, and ones the failed stage finished but never sent.
        mine = [r for r in reqs if s.reqs.get(r.rid) is r]
        with s.cache.free_group():
            for r in mine:
                if not r.finished():
                    s.cache.discard(r)  # before finish: release would cache the half-written KV
                    s.output.finish(r, reason)
        s.prefill.forget(mine)
        s.output.stream(mine)
        for r in mine:
            if s.part is not None:
                s.part.abort(r.rid)  # the role's own state of it (a PD room) ends as an abort's would
            s.reqs.pop(r.rid, None)
