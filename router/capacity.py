"""Hold for capacity: scale from zero, the router's half.

A role (prefill, decode, colocated) may run at zero replicas. A request that finds no
eligible worker of a role it needs does not get a 503 at once: it waits here until the
worker set changes (a pod joins, a worker turns healthy; see WorkerSet.changed) and the
proxy finds a route, for at most `timeout` s since the request reached the proxy. Meanwhile
`tandem_router_pending_requests{role}` counts it: that demand is what the operator scales on.

Bounds, so a role that never comes back cannot hold the router hostage:
  - at most `max_waiters` requests held at once; past that a 503 right away;
  - a wait past the deadline is a 503 `no <role> worker became ready within N s`;
  - a client that goes away while held frees its slot at once (non-streaming requests are
    cancelled by routes.run; streaming ones pass `disconnected`, raced here).
`timeout` 0 turns holding off: no worker is an immediate 503, as before scale from zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tandem.router.metrics import RouterMetrics
from tandem.router.workers import COLOCATED, DECODE, PREFILL, WorkerSet
from tandem.web.errors import ApiError

# How often a held request re-checks without a change event: a breaker half-opening is a
# matter of time, not an event. Slow on purpose; events do the real waking.
POLL_S = 0.5

Disconnected = Callable[[], Awaitable[Any]]  # returns once the client has gone away


class CapacityWait:
    def __init__(self, workers: WorkerSet, metrics: RouterMetrics, timeout: float = 0.0,
                 max_waiters: int = 1024, poll: float = POLL_S) -> None:
        self.workers, self.metrics = workers, metrics
        self.timeout, self.max_waiters, self.poll = timeout, max_waiters, poll
        self.waiting = 0  # requests held right now, all roles

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def ready(self, role: str) -> bool:
        """Whether a worker of `role` that a route could use is eligible now (no policy pick)."""
        ws = self.workers
        if role == COLOCATED:  # outside PD, decode workers serve alone too
            return bool(ws.eligible(COLOCATED) or ws.eligible(DECODE))
        generations = {d.generation for d in ws.eligible(DECODE)}
        if role == DECODE:
            return bool(generations)
        if not generations:  # waiting for prefill, the decode workers went: the proxy then names decode
            return True
        return any(p.bootstrap_port is not None and p.generation in generations for p in ws.eligible(PREFILL))

    @contextlib.asynccontextmanager
    async def hold(self, role: str, deadline: float, disconnected: Disconnected | None) -> AsyncIterator[Held]:
        """One request held; it waits with `await held.wait(role)` until the caller finds a route."""
        if self.waiting >= self.max_waiters:
            raise ApiError(503, f"no {role} worker is ready, and the router already holds {self.max_waiters} "
                                "requests waiting for capacity; retry later", code="capacity_full")
        self.waiting += 1
        held = Held(self, role, deadline, disconnected)
        try:
            yield held
        finally:
            self.waiting -= 1
            held.close()


class Held:
    """One held request's bookkeeping: its pending gauge (under the role it waits for now)
    and the watch on its client."""

    def __init__(self, owner: CapacityWait, role: str, deadline: float, disconnected: Disconnected | None) -> None:
        self.owner, self.deadline, self.role = owner, deadline, ""
        self.gone = asyncio.ensure_future(_watch(disconnected)) if disconnected is not None else None
        self._count(role)

    def _count(self, role: str) -> None:
        """A request that got its decode worker may next wait for a prefill one: move its gauge."""
        if role == self.role:
            return
        m = self.owner.metrics
        if self.role:
            m.pending.labels(self.role).dec()
        m.pending.labels(role).inc()
        m.capacity_waits.labels(role).inc()
        self.role = role

    async def wait(self, role: str) -> None:
        """Until the worker set changes (or a poll tick); 503 past the deadline."""
        self._count(role)
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.owner.metrics.capacity_timeouts.labels(role).inc()
            raise ApiError(503, f"no {role} worker became ready within {self.owner.timeout:g} s",
                           code="capacity_timeout")
        changed = asyncio.ensure_future(self.owner.workers.changed(min(left, self.owner.poll)))
        try:
            await asyncio.wait({changed} if self.gone is None else {changed, self.gone},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if self.gone is not None and self.gone.done():
            raise ApiError(400, "the client disconnected while its request waited for a worker")  # nobody reads it

    def close(self) -> None:
        self.owner.metrics.pending.labels(self.role).dec()
        if self.gone is not None:
            self.gone.cancel()


async def _watch(disconnected: Disconnected) -> None:
    """The client watch, ending quietly: a receive that fails also means the client is gone."""
    with contextlib.suppress(Exception):
        await disconnected()
