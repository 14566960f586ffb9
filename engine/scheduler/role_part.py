"""The seam between the scheduler and a disaggregated role: what prefill and decode add, and
the narrow host they are given in its place.

A colocated scheduler runs with no part. A prefill worker's part (prefill/sender.py) holds
each request's KV after its one token until decode has pulled it; a decode worker's part
(decode/receiver.py) admits requests whose KV arrives from a prefill worker instead of being
computed.

    scheduler --hooks--> RolePart          admit, abort, poll, on_batch_done, on_retire, ...
    RolePart  --verbs--> Host              queue_prefill, join_decoding, end, retire, release_held

The scheduler calls the hooks; a hook answers with a decision (admit: the part holds the
request, leaves it to the prefill queue, or refuses it; abort: the part ends it or not;
on_retire: the part holds the request's KV or not) rather than calling back into the
scheduler's managers. A part
moves a request only through the Host's verbs, all in engine/scheduler/lifecycle.py, the one
place a request ends.

Whoever builds the scheduler picks the role: it passes an `AttachRole` (prefill/role.py,
decode/role.py), so the engine imports nothing from the roles built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import queue

    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.kvcache.memory_pool import TokenToKVPool
    from tandem.engine.parallel.group import TPGroup
    from tandem.engine.parallel.tick import TickCodec
    from tandem.engine.scheduler.cache_manager import CacheManager
    from tandem.engine.scheduler.req import FinishReason, KVFate, Req
    from tandem.engine.scheduler.schedule_batch import ScheduleBatch
    from tandem.protocol.messages import GenerateReq


class Admission(Enum):
    """A part's answer to a new request (or a FinishReason: refused, the engine retires it)."""

    LOCAL = "local"  # the scheduler's prefill queue computes it, as colocated
    HELD = "held"  # the part holds it (a PD room) and moves it on through the Host's verbs


class Host(Protocol):
    """What a role part sees of the engine (engine/scheduler/lifecycle.py implements it)."""

    config: EngineConfig  # frozen
    tp: TPGroup
    dp_rank: int
    inbox: queue.Queue | queue.SimpleQueue  # where the part's control channel posts its messages
    kv_pool: TokenToKVPool  # its layout and buffer: what the transfer agent registers
    vocab_size: int
    cache: CacheManager  # pages, rows and the prefix cache: a room's reservation and its reads
    now: float  # this iteration's clock (rank 0's under TP: every rank times out alike)

    @property
    def new_token_ratio(self) -> float: ...

    def kv_headroom(self) -> float:
        """KV tokens free or evictable beyond what the running batch is expected to need."""

    def queue_prefill(self, req: Req) -> None:
        """Compute the request here: it joins the prefill queue."""

    def join_decoding(self, req: Req, token: int, logprob: float | None, top: list) -> None:
        """A request prefilled elsewhere joins the running batch with its first token."""

    def end(self, req: Req, reason: FinishReason) -> bool:
        """End it now, or at its next result if a launched batch holds it."""

    def retire(self, req: Req, reason: FinishReason, kv: KVFate = ...) -> None:
        """End it now: the only way a request ends."""

    def release_held(self, req: Req, kv: KVFate = ...) -> None:
        """A request retired with its KV held: the KV is done with, the request settles."""


class RolePart(Protocol):
    # The part's own inbox messages (control-channel frames, peer events) and their handlers.
    handlers: Mapping[type, Callable[[Any], Any]]
    # Those messages reach TP rank 0's inbox alone: rank 0 passes them on in its tick.
    tick_codec: TickCodec
    # Hand out free KV pages lowest-first so a request's pages are mostly consecutive: a KV
    # transfer then moves each run as one descriptor per layer and K/V, not one per page.
    contiguous_pages: bool

    def admit(self, req: Req, msg: GenerateReq) -> Admission | FinishReason:
        """Hold a new request, leave it to the prefill queue, or refuse it (why)."""

    def abort(self, rid: str) -> bool:
        """End the request if the part holds it (True); otherwise the scheduler aborts it."""

    def poll(self) -> None:
        """Advance transfers and handshakes; called once per loop iteration."""

    def on_batch_done(self, batch: ScheduleBatch) -> None:
        """A batch's results are processed: start sends for requests that finished prefill."""

    def on_retire(self, req: Req) -> bool:
        """The engine is retiring `req` (its finish fields are set): end the part's own state of
        it, and answer True to hold its KV and registry entry until the part calls
        Host.release_held (after its sends), False to let the engine release them now."""

    def busy(self) -> bool:
        """Work the part holds that no request shows (a transfer in flight)."""

    def check_integrity(self) -> None:
        """The part's own bookkeeping is consistent; runs when the scheduler is idle."""

    def status(self) -> dict[str, Any]:
        """Counters for /debug/pool and /get_server_info."""


AttachRole = Callable[[Host, str], RolePart]  # (host, model path) -> the part, attached
