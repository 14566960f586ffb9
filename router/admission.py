"""Admission: a token-bucket rate limit and a concurrency cap, with one bounded FIFO queue.

A request goes through at once when a slot is free, the bucket has a token and nobody is
queued ahead of it; otherwise it waits in the queue, in arrival order. A full queue, or a
wait past `queue_timeout`, answers 429 (the OpenAI status for "slow down"): nothing waits
unbounded and nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from tandem.web.errors import ApiError


class TokenBucket:
    def __init__(self, rate: float | None, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.t = float(burst), time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        if self.rate is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now

    def take(self) -> bool:
        if self.rate is None:
            return True
        self._refill()
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def wait_time(self) -> float:
        return 0.0 if self.rate is None else max(0.0, (1 - self.tokens) / self.rate)


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, queue_timeout: float, rate: float | None = None,
                 burst: int = 1) -> None:
        self.max_inflight, self.max_queue, self.queue_timeout = max_inflight, max_queue, queue_timeout
        self.bucket = TokenBucket(rate, max(1, burst))
        self.inflight = 0
        self.queue: deque[asyncio.Future] = deque()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        self.inflight -= 1
        self._wake()

    async def acquire(self) -> None:
        if not self.queue and self.inflight < self.max_inflight and self.bucket.take():
            self.inflight += 1
            return
        if len(self.queue) >= self.max_queue:
            raise ApiError(429, f"the router's queue is full ({self.max_queue} waiting); retry later")
        fut = asyncio.get_running_loop().create_future()
        self.queue.append(fut)
        deadline = time.monotonic() + self.queue_timeout
        try:
            while True:
                self._wake()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(429, f"waited {self.queue_timeout:.0f} s in the router's queue; retry later")
                try:
                    await asyncio.wait_for(asyncio.shield(fut), min(left, max(0.005, self.bucket.wait_time())))
                    return  # _wake admitted us (and counted us in flight)
                except TimeoutError:
                    continue
        finally:
            if fut in self.queue:
                self.queue.remove(fut)

    def _wake(self) -> None:
        """Admit queued requests in order while a slot and a token are there."""
        while self.queue and self.inflight < self.max_inflight:
            head = self.queue[0]
            if head.done():
                self.queue.popleft()
                continue
            if not self.bucket.take():
                return
            self.queue.popleft()
            self.inflight += 1
            head.set_result(None)
