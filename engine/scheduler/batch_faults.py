"""A failing request fails alone: an exception in one batch fails that batch's requests, and
the scheduler goes on with the rest.

The loop's stages, and whom a failure in each is traced to:

    build    get_next_batch_to_run        the requests the batch was built from (BatchFailed,
             get_model_worker_batch       raised by the ScheduleBatch methods marked @traced:
                                          batch_failure.py)
    run      forward + sample             the batch's requests (under overlap, through its future)
    process  process_batch_result         the batch's requests

A failed request is retired with an abort (HTTP 500 before its first token) and its KV
discarded, never cached: the forward that raised may have left its new KV half written, and
the prefix cache would hand that to the next request with the same prefix.

Some faults leave the device or the pools in an unknown state (`is_fatal`): a CUDA error, an
out-of-memory, a failed integrity assertion, a failure of the scheduler's own bookkeeping that
no batch can be named for. Those are not contained: they end the scheduler, its worker exits,
and Kubernetes or `tandem up --restart` replaces it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from tandem.engine.scheduler.batch_failure import BatchFailed, is_fatal
from tandem.engine.scheduler.req import KVFate, Req, finish_abort

if TYPE_CHECKING:
    from tandem.engine.scheduler.lifecycle import Lifecycle

log = logging.getLogger(__name__)

T = TypeVar("T")


class BatchFaults:
    """The scheduler's containment of batch failures (see the module docstring)."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
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
        self.failed_batches += 1
        log.error("a batch of %d request(s) failed; failing them alone", len(reqs), exc_info=exc)
        reason = finish_abort(f"the engine failed on this request's batch: {type(exc).__name__}: {exc}", 500)
        # Requests the failed stage had already ended were retired there (their last output is out).
        self.life.retire_all([r for r in reqs if not r.finished()], reason, KVFate.DISCARD)
        self.life.output.flush()
