"""The seam between the scheduler and a disaggregated role: what prefill and decode add.

A colocated scheduler runs with no part. A prefill worker's part (prefill/sender.py) holds
each request's KV after its one token until decode has pulled it; a decode worker's part
(decode/receiver.py) admits requests whose KV arrives from a prefill worker instead of being
computed. The scheduler calls these hooks and nothing else; the part reaches the scheduler
through its public managers (cache, output, reqs), never by replacing them.

Whoever builds the scheduler picks the role: it passes an `AttachRole` (prefill/role.py,
decode/role.py), so the engine imports nothing from the roles built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandem.engine.parallel.tick import TickCodec
    from tandem.engine.scheduler.req import Req
    from tandem.engine.scheduler.schedule_batch import ScheduleBatch
    from tandem.engine.scheduler.scheduler import Scheduler
    from tandem.protocol.messages import GenerateReq


class RolePart(Protocol):
    # The part's own inbox messages (control-channel frames, peer events) and their handlers.
    handlers: Mapping[type, Callable[[Any], Any]]
    # Those messages reach TP rank 0's inbox alone: rank 0 passes them on in its tick.
    tick_codec: TickCodec
    # Hand out free KV pages lowest-first so a request's pages are mostly consecutive: a KV
    # transfer then moves each run as one descriptor per layer and K/V, not one per page.
    contiguous_pages: bool

    def admit(self, req: Req, msg: GenerateReq) -> bool:
        """Take a new request (True), or leave it to the scheduler's prefill queue (False)."""

    def abort(self, rid: str) -> bool:
        """End the request if the part holds it (True); otherwise the scheduler aborts it."""

    def poll(self) -> None:
        """Advance transfers and handshakes; called once per loop iteration."""

    def on_batch_done(self, batch: ScheduleBatch) -> None:
        """A batch's results are processed: start sends for requests that finished prefill."""

    def release(self, req: Req) -> bool:
        """A finished request's KV: True when the part frees it later (after its sends)."""

    def busy(self) -> bool:
        """Requests held by the part (KV in flight): the scheduler is not idle."""

    def check_integrity(self) -> None:
        """The part's own bookkeeping is consistent; runs when the scheduler is idle."""

    def status(self) -> dict[str, Any]:
        """Counters for /debug/pool and /get_server_info."""


AttachRole = Callable[["Scheduler", str], RolePart]  # (scheduler, model path) -> the attached part
