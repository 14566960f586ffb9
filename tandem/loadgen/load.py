"""Offered load: sessions arrive as a Poisson process at a fixed rate, or a fixed number
run at once (closed loop). Warm-up sessions run first and are not reported; a duration
bound stops new arrivals, and whatever is in flight then still finishes and counts.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tandem.loadgen.client import Result, send
from tandem.loadgen.workloads import Session


@dataclass(frozen=True)
class LoadSpec:
    rate: float | None = None  # sessions per second (Poisson); None with concurrency: closed loop
    concurrency: int | None = None  # sessions in flight at once (also caps an open-loop rate's backlog)
    warmup: int = 0
    duration: float | None = None  # seconds of arrivals
    timeout: float = 600.0  # per request
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is None and self.concurrency is None:
            raise ValueError("give a request rate, a concurrency, or both")
        if (self.rate is not None and self.rate <= 0) or (self.concurrency is not None and self.concurrency < 1):
            raise ValueError("rate must be > 0 and concurrency >= 1")


async def run_session(client: httpx.AsyncClient, model: str, session: Session, chat: bool) -> list[Result]:
    """One session's turns in order; a chat session resends its history each turn."""
    results, history = [], []
    if session.system is not None and chat:
        history.append({"role": "system", "content": session.system})
    for turn in session.turns:
        if chat or len(session.turns) > 1:
            history.append({"role": "user", "content": turn.text})
            prompt: str | list[dict] = list(history)
        else:
            prompt = f"{session.system}\n\n{turn.text}" if session.system else turn.text
        res = await send(client, model, prompt, turn.max_tokens)
        results.append(res)
        if not res.ok:
            break  # the rest of the conversation depends on this reply
        history.append({"role": "assistant", "content": res.text})
    return results


async def drive(base_url: str, model: str, sessions: list[Session], load: LoadSpec, chat: bool = False,
                headers: dict[str, str] | None = None, tick: Callable[[int], None] = lambda n: None,
                ) -> tuple[list[Result], float]:
    """Run the workload; returns the measured results and the measured wall time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, timeout=load.timeout, limits=limits,
                                 headers=headers or {}) as client:
        warm, measured = sessions[:load.warmup], sessions[load.warmup:]
        if warm:
            await _arrive(client, model, warm, load, chat, lambda n: None)
        start = time.perf_counter()
        results = await _arrive(client, model, measured, load, chat, tick)
        return results, time.perf_counter() - start


async def _arrive(client: httpx.AsyncClient, model: str, sessions: list[Session], load: LoadSpec, chat: bool,
                  tick: Callable[[int], None]) -> list[Result]:
    rng = random.Random(load.seed)
    gate = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    start, tasks = time.perf_counter(), []

    async def one(s: Session) -> list[Result]:
        try:
            return await run_session(client, model, s, chat)
        finally:
            if gate:
                gate.release()
            tick(1)

    next_at = start
    for s in sessions:
        if load.duration is not None and time.perf_counter() - start >= load.duration:
            break
        if load.rate is not None:
            next_at += rng.expovariate(load.rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if gate:
            await gate.acquire()
        tasks.append(asyncio.create_task(one(s)))
    done = await asyncio.gather(*tasks)
    return [r for rs in done for r in rs]
