"""Soak: 5,000 requests at concurrency 64 on the tiny model (about a minute on 2 cores) under
--full, 2,500 in the smoke form: no errors, and the worker's memory (front and scheduler
processes together) grows at most 5% between request 1,000 and the last.
TANDEM_SOAK_REQUESTS changes the count."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import httpx
import pytest
from smoke import sized
from worker_process import Worker

REQUESTS = int(os.environ.get("TANDEM_SOAK_REQUESTS", sized(2500, 5000)))
# The first RSS reading: warm-up (shapes, caches) is over by then; at request 400 it was not.
MARK = min(1000, REQUESTS // 2)
CONCURRENCY = 64


def rss_bytes(pid: int) -> int:
    """RSS of a process and its children (the scheduler process)."""
    total = 0
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(c) for c in (task / "children").read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.slow
def test_soak_no_errors_and_flat_memory(model_path) -> None:
    rng = random.Random(0)
    bodies = [{"model": "tiny", "prompt": " ".join(rng.choice("abcdefgh") for _ in range(rng.randint(4, 40))),
               "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0.0, 0.8]),
               "stream": rng.random() < 0.5} for _ in range(REQUESTS)]
    with Worker.colocated(model_path("tiny"), "--max-total-tokens", "32768") as w:
        marks: dict[str, int] = {}
        errors: list[str] = []
        done = 0

        async def one(client: httpx.AsyncClient, body: dict) -> None:
            nonlocal done
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200 or (body["stream"] and not r.text.endswith("data: [DONE]\n\n")):
                errors.append(f"{r.status_code} {r.text[:200]}")
            done += 1
            if done == MARK:
                marks["early"] = rss_bytes(w.proc.pid)

        async def main() -> None:
            sem = asyncio.Semaphore(CONCURRENCY)
            limits = httpx.Limits(max_connections=CONCURRENCY)
            async with httpx.AsyncClient(base_url=w.url, timeout=300, limits=limits) as client:
                async def gated(body: dict) -> None:
                    async with sem:
                        await one(client, body)

                await asyncio.gather(*(gated(b) for b in bodies))

        asyncio.run(main())
        marks["end"] = rss_bytes(w.proc.pid)
        assert not errors, errors[:5]
        growth = marks["end"] / marks["early"] - 1
        early, end = marks["early"] / 2**20, marks["end"] / 2**20
        print(f"soak: {REQUESTS} requests, RSS at request {MARK} {early:.0f} MiB, at the end {end:.0f} MiB "
              f"({growth:+.1%})")
        assert growth <= 0.05, marks
        assert w.pool()["whole"]
