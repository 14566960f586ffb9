"""Admission: a token-bucket rate limit and a concurrency cap, with one bounded FIFO queue.

A request goes through at once when a slot is free, the bucket has a token and nobody is
queued ahead of it; otherwise it waits in the queue, in arrival order. A full queue, or a
wait past `queue_timeout`, answers 429 (the OpenAI status for "slow down"): nothing waits
unbounded and nothing is dropped silently.

A request holds one slot per sequence it opens (prompts x n), and at most limits.MAX_REQUEST_SHARE of
them: one batch of thousands took a single slot, then nearly every slot of the worker it
reached, and the other clients got 429s. Past its share it is a 400, since waiting cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from tandem.protocol.limits import max_sequences_per_request
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
        self.inflight = 0  # requests admitted (the metrics' and the drain's count)
        self.slots = 0  # what they hold: one per sequence
        self.queue: deque[tuple[asyncio.Future, int]] = deque()  # (admitted, slots it needs)

    @property
    def max_per_request(self) -> int:
        return max_sequences_per_request(self.max_inflight)

    @contextlib.asynccontextmanager
    async def slot(self, weight: int = 1) -> AsyncIterator[None]:
        await self.acquire(weight)
        try:
            yield
        finally:
            self.release(weight)

    def release(self, weight: int = 1) -> None:
        self.inflight -= 1
        self.slots -= weight
        self._wake()

    async def acquire(self, weight: int = 1) -> None:
        """Takes `weight` slots: one per sequence the request opens."""
        if weight > self.max_per_request:
            raise ApiError(400, f"this request opens {weight} sequences (prompts x n); the router admits at most "
                                f"{self.max_per_request} per request, a quarter of its {self.max_inflight} slots",
                           param="n")
        if not self.queue and self.slots + weight <= self.max_inflight and self.bucket.take():
            self._admit(weight)
            return
        if len(self.queue) >= self.max_queue:
            raise ApiError(429, f"the router's queue is full ({self.max_queue} waiting); retry later")
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, weight)
        self.queue.append(entry)
        deadline = time.monotonic() + self.queue_timeout
        try:
            while True:
                self._wake()
                if fut.done():  # admitted just now: its slots are counted, so it must not give up
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(429, f"waited {self.queue_timeout:.0f} s in the router's queue; retry later")
                try:
                    await asyncio.wait_for(asyncio.shield(fut), min(left, max(0.005, self.bucket.wait_time())))
                    return  # _wake admitted us (and counted us in flight)
                except TimeoutError:
                    continue
        finally:
            if entry in self.queue:
                self.queue.remove(entry)

    def _wake(self) -> None:
        """Admit queued requests in order while their slots and a token are there."""
        while self.queue:
            head, weight = self.queue[0]
            if head.done():
                self.queue.popleft()
                continue
            if self.slots + weight > self.max_inflight or not self.bucket.take():
                return
            self.queue.popleft()
            self._admit(weight)
            head.set_result(None)

    def _admit(self, weight: int) -> None:
        self.inflight += 1
        self.slots += weight
