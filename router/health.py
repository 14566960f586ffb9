"""Active health checks: every `interval` seconds, GET /health/ready on each worker.

A worker becomes unhealthy after `fail_threshold` consecutive failures (no answer within
`timeout`, or a non-200: a draining worker answers 503 and gets no new requests) and
healthy again after `ok_threshold` consecutive successes. A healthy answer also closes an
open breaker's books: the worker is back (a restarted pod is readmitted this way).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from tandem.router.workers import Worker, WorkerSet
from tandem.worker_contract import READY_PATH

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, workers: WorkerSet, client: httpx.AsyncClient, interval: float = 2.0, timeout: float = 2.0,
                 fail_threshold: int = 2, ok_threshold: int = 1) -> None:
        self.workers, self.client = workers, client
        self.interval, self.timeout = interval, timeout
        self.fail_threshold, self.ok_threshold = fail_threshold, ok_threshold
        self.oks: dict[str, int] = {}

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.workers.values())))

    async def check(self, w: Worker) -> None:
        try:
            ok = (await self.client.get(w.url + READY_PATH, timeout=self.timeout)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            w.fails = 0
            self.oks[w.url] = self.oks.get(w.url, 0) + 1
            if not w.healthy and self.oks[w.url] >= self.ok_threshold:
                log.info("worker %s is healthy again", w.url)
                w.healthy = True
                w.breaker.on_success()
                self.workers.touch()  # requests held for capacity may go now
        else:
            self.oks[w.url] = 0
            w.fails += 1
            if w.healthy and w.fails >= self.fail_threshold:
                log.warning("worker %s is unhealthy (%d failed checks)", w.url, w.fails)
                w.healthy = False
