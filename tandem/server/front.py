"""The front's request table: what sits between the HTTP handlers and the schedulers.

    handler --submit--> Front --GenerateReq--> scheduler process(es)   (zmq, via SchedulerClient)
    handler <--ReqOutput-- per-request asyncio.Queue <--emit-- client reader thread

Outputs arrive on the client's reader thread and are handed to the event loop in one
call per batch. A request lives in `active` from admission until its stream is closed;
closing a stream that has not finished sends AbortReq, so a client that goes away frees
its pages. Admission is bounded (429 past the limit) and stops while draining (503). One
request's sequences (prompts x n) may hold at most limits.MAX_REQUEST_SHARE of the slots: a single
batch used to take nearly all of them, leaving every other client 429s.

The schedulers know a request only by the id this front gives it, unique for the front's
life. A client's own `rid` (/generate's) is a name kept beside it, for /abort_request and
for the answer: a client that reuses its rid right after a disconnect reaches its new
request, while the old one's late outputs and abort still go to the old one.

A scheduler that dies fails every waiting request, and `on_down` is called: the server then
exits, so that Kubernetes or `tandem up --restart` replaces the worker (app.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.protocol.limits import max_sequences_per_request
from tandem.protocol.messages import AbortReq, AdminResult, GenerateReq, ReqOutput, StatusReq
from tandem.web.errors import ApiError

log = logging.getLogger(__name__)


class SchedulerDown(ApiError):
    """The scheduler died under a waiting request: a 503 (retryable elsewhere), not a bug's 500."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


@dataclass
class Stream:
    """One request's outputs, in order; the last one has finished=True."""

    rid: str  # the schedulers' key, made by the front
    client_rid: str | None = None  # the client's name for it, if it gave one
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    finished: bool = False
    aborted: bool = False  # by /abort_request or a drain: its abort is an answer, not an error
    first_token: float | None = None
    last_token: float | None = None

    async def next(self) -> ReqOutput:
        out = await self.queue.get()
        if isinstance(out, BaseException):
            raise out
        self.finished = out.finished
        return out

    @property
    def name(self) -> str:
        """The id the client sees: its own rid, or the front's."""
        return self.client_rid or self.rid


class Front:
    def __init__(self, client_factory: Callable[[Callable[[list[Any]], None]], Any],
                 max_active: int, observe: Callable[[Stream, ReqOutput], None] = lambda s, o: None,
                 on_down: Callable[[], None] = lambda: None) -> None:
        """client_factory(emit) builds the SchedulerClient (it blocks until the model is loaded)."""
        self.loop = asyncio.get_running_loop()
        self.active: dict[str, Stream] = {}  # by the front's id
        self.named: dict[str, Stream] = {}  # in-flight requests by their client's rid
        self.on_down = on_down
        self.admin_waiters: dict[str, tuple[int, list[AdminResult], asyncio.Future]] = {}
        self.max_active = max_active
        self.observe = observe
        self.draining = False
        self._ids = itertools.count()
        self.client = client_factory(self._emit)
        self.dp_size = getattr(getattr(self.client, "config", None), "dp_size", 1)
        self._watchdog = asyncio.create_task(self._watch())

    # ---- outputs (reader thread -> loop) ----------------------------------------------------------
    def _emit(self, outs: list[Any]) -> None:
        self.loop.call_soon_threadsafe(self._deliver, outs)

    def _deliver(self, outs: list[Any]) -> None:
        for o in outs:
            if isinstance(o, AdminResult):
                waiter = self.admin_waiters.get(o.rid)
                if waiter is not None:
                    waiter[1].append(o)
                    if len(waiter[1]) == waiter[0] and not waiter[2].done():
                        waiter[2].set_result(waiter[1])
                continue
            stream = self.active.get(o.rid)
            if stream is not None:  # else: closed already (aborted by its client)
                self.observe(stream, o)
                stream.queue.put_nowait(o)
                if o.finished:  # its admission slot and rid are free now, read or not: a client that
                    self._forget(stream)  # stops reading holds its connection, never capacity

    async def _watch(self) -> None:
        """A dead scheduler fails every waiting request instead of leaving it hanging."""
        while self.error is None:
            await asyncio.sleep(0.1)
        log.error("scheduler stopped: %r", self.error)
        for s in list(self.active.values()):
            s.queue.put_nowait(SchedulerDown(f"the scheduler stopped: {self.error!r}"))
        for _, _, fut in self.admin_waiters.values():
            if not fut.done():
                fut.set_exception(SchedulerDown("the scheduler stopped"))
        self.on_down()

    @property
    def error(self) -> BaseException | None:
        return self.client.error

    @property
    def info(self) -> dict[str, Any]:
        return self.client.info

    # ---- requests -----------------------------------------------------------------------------------
    @property
    def max_per_request(self) -> int:
        return max_sequences_per_request(self.max_active)

    def admit(self, count: int) -> None:
        """Before a request opens its `count` sequences: a 400 past its share of the slots
        (waiting cannot help), a 429 when too few are free (so nothing is opened in vain)."""
        if count > self.max_per_request:
            raise ApiError(400, f"this request opens {count} sequences (prompts x n); this worker admits at most "
                                f"{self.max_per_request} per request, a quarter of its {self.max_active} slots",
                           param="n")
        if len(self.active) + count > self.max_active:
            raise ApiError(429, f"too many requests in flight ({self.max_active}); retry later")

    def open(self, input_ids: list[int], sampling: dict[str, Any], client_rid: str | None = None,
             **bootstrap: Any) -> Stream:
        """Admit one request and send it; the caller must `close` the stream."""
        if self.error is not None:
            raise ApiError(503, "the scheduler is not running")
        if self.draining:
            raise ApiError(503, "the server is draining and admits no new requests")
        if len(self.active) >= self.max_active:
            raise ApiError(429, f"too many requests in flight ({self.max_active}); retry later")
        if client_rid is not None and client_rid in self.named:
            raise ApiError(400, f"request id {client_rid!r} is already in flight", param="rid")
        rid = f"{next(self._ids)}-{uuid.uuid4().hex[:12]}"
        stream = self.active[rid] = Stream(rid, client_rid)
        if client_rid is not None:
            self.named[client_rid] = stream
        try:
            self.client.send(GenerateReq(rid, list(input_ids), sampling, **bootstrap))
        except RuntimeError as exc:  # a rank is gone (the client raises rather than block)
            self._forget(stream)
            raise ApiError(503, f"the scheduler is not running: {exc}") from None
        return stream

    def close(self, stream: Stream) -> None:
        if self._forget(stream) and not stream.finished and self.error is None:
            self._send_quietly(AbortReq(stream.rid))

    def _forget(self, stream: Stream) -> bool:
        """Drop the stream from both tables; False if it was closed already."""
        self._unname(stream)
        return self.active.pop(stream.rid, None) is not None

    def _unname(self, stream: Stream) -> None:
        if stream.client_rid is not None and self.named.get(stream.client_rid) is stream:
            del self.named[stream.client_rid]

    def _send_quietly(self, msg: Any) -> None:
        """Best-effort sends (aborts): a dead scheduler has nothing left to abort."""
        try:
            self.client.send(msg)
        except RuntimeError:
            pass

    def abort(self, rid: str) -> bool:
        """/abort_request: `rid` is what the client sees (`Stream.name`): its own, or the front's."""
        stream = self.named.get(rid) or self.active.get(rid)
        if stream is None:
            return False
        self._abort(stream)
        return True

    def _abort(self, stream: Stream) -> None:
        stream.aborted = True
        self._unname(stream)  # its client may reuse the rid at once; its last answer still reaches it
        self._send_quietly(AbortReq(stream.rid))

    # ---- admin --------------------------------------------------------------------------------------
    async def admin(self, make: Callable[[str], Any], timeout: float = 30.0) -> list[AdminResult]:
        """Send an admin command to every rank and collect the answers."""
        if self.error is not None:
            raise ApiError(503, "the scheduler is not running")
        rid = f"admin-{uuid.uuid4().hex[:12]}"
        fut = self.loop.create_future()
        self.admin_waiters[rid] = (self.dp_size, [], fut)
        try:
            self.client.send(make(rid))
            return await asyncio.wait_for(fut, timeout)
        except RuntimeError as exc:
            raise ApiError(503, f"the scheduler is not running: {exc}") from None
        except TimeoutError:
            raise ApiError(503, f"the scheduler did not answer within {timeout:.0f} s") from None
        finally:
            self.admin_waiters.pop(rid, None)

    async def pool_state(self) -> list[dict[str, Any]]:
        return sorted((r.info for r in await self.admin(StatusReq)), key=lambda p: p["dp_rank"])

    async def drain(self, timeout: float) -> dict[str, Any]:
        """Stop admission, let in-flight requests finish for `timeout` seconds, abort the
        rest, and wait (bounded) until every rank is idle; report the pools' state."""
        self.draining = True
        t0, in_flight = time.monotonic(), len(self.active)
        while self.active and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.05)
        aborted = list(self.active)
        for rid in aborted:
            self._abort(self.active[rid])
        deadline = time.monotonic() + 30
        pools = await self.pool_state()
        while not all(p["idle"] for p in pools) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            pools = await self.pool_state()
        whole = all(p["whole"] for p in pools)
        log.info("drained in %.1f s: %d in flight, %d aborted, KV pool %s", time.monotonic() - t0,
                 in_flight, len(aborted), "whole" if whole else f"NOT whole: {pools}")
        return {"in_flight": in_flight, "aborted": len(aborted), "pool_whole": whole, "pools": pools}

    def shutdown(self) -> None:
        self._watchdog.cancel()
        self.client.shutdown()
