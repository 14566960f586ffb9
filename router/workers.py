"""The workers the router knows: their role, load, health and circuit breaker.

Load is counted by the router itself, per request, from dispatch until the last byte
reaches the client or the request is cancelled (a stream is load until it ends):
`requests` in flight and `tokens` outstanding (prompt + max_tokens).

A worker is eligible for new requests when it is healthy (active checks), its breaker
lets requests through, and it is not being removed (draining, deleted pod).

The set wakes requests held for capacity (router/capacity.py) when it changes: a worker
added, removed or found healthy again. A breaker half-opening is a matter of time, not an
event; the holders also re-check on a slow timer for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

COLOCATED, PREFILL, DECODE = "colocated", "prefill", "decode"


@dataclass
class Breaker:
    """Counts worker faults only (connect errors, timeouts, 5xx), never 4xx: a client's bad
    request says nothing about the worker. closed -> open after `threshold` consecutive
    faults; after `cooldown` s one trial request (half-open) closes or reopens it."""

    threshold: int = 5
    cooldown: float = 10.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)  # tests step it by hand
    faults: int = 0
    opened_at: float | None = None
    trial: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown else "open"

    def allows(self) -> bool:
        s = self.state
        return s == "closed" or (s == "half_open" and not self.trial)

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self.trial = True

    def on_success(self) -> None:
        self.faults, self.opened_at, self.trial = 0, None, False

    def on_fault(self) -> None:
        self.faults += 1
        if self.opened_at is not None or self.faults >= self.threshold:
            self.opened_at, self.trial = self.clock(), False


@dataclass(eq=False)
class Worker:
    url: str
    role: str = COLOCATED
    bootstrap_port: int | None = None  # prefill only
    generation: str = ""  # PD pairs only workers of one model generation
    requests: int = 0
    tokens: int = 0
    healthy: bool = True
    removing: bool = False
    fails: int = 0  # consecutive failed health checks
    breaker: Breaker = field(default_factory=Breaker)

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.removing and self.breaker.allows()

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[-1].rsplit(":", 1)[0]


class WorkerSet:
    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        # Made on the first wait, not here: a set built outside a running loop must not bind one.
        self._changed: asyncio.Event | None = None

    def add(self, w: Worker) -> Worker:
        w.url = w.url.rstrip("/")
        old = self.workers.get(w.url)
        if old is not None:  # re-added (a restarted pod): keep its load, refresh the rest
            old.role, old.bootstrap_port, old.generation, old.removing = w.role, w.bootstrap_port, w.generation, False
            self.touch()
            return old
        self.workers[w.url] = w
        self.touch()
        return w

    def remove(self, url: str) -> Worker | None:
        w = self.workers.pop(url.rstrip("/"), None)
        if w is not None:
            self.touch()
        return w

    def touch(self) -> None:
        """Wake every waiter in changed(): the set, or a worker's health, changed."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def changed(self, timeout: float) -> None:
        """Return at the next touch(), or after `timeout` s, whichever comes first."""
        if self._changed is None:
            self._changed = asyncio.Event()
        event = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()

    def eligible(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.eligible]

    def roles(self) -> set[str]:
        return {w.role for w in self.workers.values()}
