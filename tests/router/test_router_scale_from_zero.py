"""Scale from zero, the router's half: a request that finds no worker of a role it needs is
held (not a 503) until one joins, and the demand shows in tandem_router_pending_requests.
The real router app and fake workers (bench/fake_worker.py, no model) run in-process under
uvicorn on 127.0.0.1, on sockets bound to free ports, and are always stopped."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from router_fakes import serving

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from tandem.metric_names import (  # noqa: E402
    ROUTER_CAPACITY_TIMEOUTS_TOTAL,
    ROUTER_CAPACITY_WAITS_TOTAL,
    ROUTER_PENDING_REQUESTS,
    ROUTER_ROLES,
)
from tandem.router.app import build_app  # noqa: E402
from tandem.router.config import RouterConfig  # noqa: E402
from tandem.router.workers import DECODE, PREFILL, Worker, WorkerSet  # noqa: E402

_spec = importlib.util.spec_from_file_location("fake_worker", Path(__file__).parents[2] / "bench" / "fake_worker.py")
fake_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_worker)

ADMIN = {"Authorization": "Bearer admin-key"}  # the admin routes on the main listener (security.py)
SHORT = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}  # 2 byte-tokens: decode alone in PD
LONG = {"text": "a long prompt " * 20, "sampling_params": {"max_new_tokens": 4}}  # 280: needs a prefill


class Counted:
    """A fake worker that counts the POSTs (requests routed to it). Its first token takes
    0.2 s: a decode answer cancels its prefill's when it comes first (real decode waits for
    the KV), and a prefill request cancelled before it is sent would not be counted."""

    def __init__(self) -> None:
        self.app, self.posts = fake_worker.build(0.2, 0.005, 4), 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.posts += 1
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def stack(n_workers: int = 0, **cfg: Any) -> AsyncIterator[tuple[str, list[tuple[Counted, str]]]]:
    """`n_workers` fake workers (not registered with the router) and a router configured by `cfg`,
    where a worker's url may be given as its index in the list (`prefill=((0, 1),)`)."""
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for _ in range(n_workers):
            w = Counted()
            workers.append((w, await stack.enter_async_context(serving(w, lifespan="on"))))
        url = lambda i: workers[i][1]  # noqa: E731
        if "prefill" in cfg:
            cfg["prefill"] = tuple((url(i), port) for i, port in cfg["prefill"])
        for key in ("workers", "decode"):
            if key in cfg:
                cfg[key] = tuple(url(i) for i in cfg[key])
        config = RouterConfig(model_name="tiny", health_interval=0.1, admin_key="admin-key", **cfg)
        yield await stack.enter_async_context(serving(build_app(config), lifespan="on")), workers


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


async def series(client: httpx.AsyncClient, router: str, name: str, role: str) -> float:
    text = (await client.get(router + "/metrics")).text
    m = re.search(rf'^{name}{{role="{role}"}} (\S+)$', text, re.M)
    assert m, f"no {name}{{role={role!r}}} in /metrics"
    return float(m.group(1))


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)  # sleep-ok: poll interval of this module's async `until`


async def pending(client: httpx.AsyncClient, router: str, role: str) -> float:
    return await series(client, router, ROUTER_PENDING_REQUESTS, role)


async def held(client: httpx.AsyncClient, router: str, role: str, n: float = 1.0) -> None:
    """Wait until `n` requests are held for `role`."""
    async def check() -> bool:
        return await pending(client, router, role) == n
    await until(check)


# ---- (a) held, then a worker joins ----------------------------------------------------------------
@pytest.mark.parametrize("shape", ["colocated", "pd_decode"])
def test_a_request_is_held_until_a_worker_joins(shape: str) -> None:
    """Colocated with no worker at all; PD with a prefill but no decode worker."""
    role = "colocated" if shape == "colocated" else DECODE
    cfg = {} if shape == "colocated" else {"prefill": ((1, 1),)}

    async def test() -> None:
        async with stack(2, capacity_wait=20, **cfg) as (router, workers), httpx.AsyncClient(timeout=20) as c:
            for r in ROUTER_ROLES:  # every series exists from the start, at 0
                for name in (ROUTER_PENDING_REQUESTS, ROUTER_CAPACITY_WAITS_TOTAL, ROUTER_CAPACITY_TIMEOUTS_TOTAL):
                    assert await series(c, router, name, r) == 0
            assert (await c.get(router + "/health/ready")).status_code == 200  # ready at zero: it can hold
            task = asyncio.create_task(c.post(router + "/generate", json=LONG))
            await held(c, router, role)
            await asyncio.sleep(0.3)  # sleep-ok: the request must stay held for a while with no worker
            assert not task.done() and await pending(c, router, role) == 1
            new, new_url = workers[0]
            added = await c.post(router + "/workers", json={"url": new_url, "role": role}, headers=ADMIN)
            assert added.status_code == 200
            r = await task
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
            assert new.posts == 1 and workers[1][0].posts == (0 if shape == "colocated" else 1)
            assert await pending(c, router, role) == 0
            assert await series(c, router, ROUTER_CAPACITY_WAITS_TOTAL, role) == 1

    run(test)


# ---- (b) PD configured, prefill at zero -------------------------------------------------------------
def test_pd_with_zero_prefill_holds_long_prompts_and_serves_short_ones() -> None:
    async def test() -> None:
        async with stack(2, capacity_wait=20, prefill=((0, 1),), decode=(1,)) as (router, workers), \
                httpx.AsyncClient(timeout=20) as c:
            (pre, pre_url), (dec, _) = workers
            removed = await c.delete(router + "/workers", params={"url": pre_url}, headers=ADMIN)
            assert removed.status_code == 200  # scaled to 0
            r = await c.post(router + "/generate", json=SHORT)  # decode prefills it itself, as before
            assert r.status_code == 200 and dec.posts == 1 and pre.posts == 0
            task = asyncio.create_task(c.post(router + "/generate", json=LONG))
            await held(c, router, PREFILL)  # still PD: the config says so, not the pods left
            assert await pending(c, router, DECODE) == 0 and dec.posts == 1
            body = {"url": pre_url, "role": PREFILL, "bootstrap_port": 1}
            assert (await c.post(router + "/workers", json=body, headers=ADMIN)).status_code == 200
            r = await task
            assert r.status_code == 200 and pre.posts == 1 and dec.posts == 2
            assert await pending(c, router, PREFILL) == 0
            assert await series(c, router, ROUTER_CAPACITY_WAITS_TOTAL, PREFILL) == 1

    run(test)


# ---- (c) timeout -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_wait_past_capacity_wait_is_a_503(stream: bool) -> None:
    async def test() -> None:
        async with stack(capacity_wait=0.4) as (router, _), httpx.AsyncClient(timeout=20) as c:
            t0 = time.monotonic()
            r = await c.post(router + "/generate", json={**LONG, "stream": stream})
            assert 0.4 <= time.monotonic() - t0 < 3
            assert r.status_code == 503
            assert r.json()["error"]["message"] == "no colocated worker became ready within 0.4 s"
            assert r.json()["error"]["type"] and "code" in r.json()["error"]
            assert await pending(c, router, "colocated") == 0
            assert await series(c, router, ROUTER_CAPACITY_TIMEOUTS_TOTAL, "colocated") == 1

    run(test)


# ---- (d) the bound on waiters ------------------------------------------------------------------------
def test_past_max_capacity_waiters_a_503_at_once() -> None:
    async def test() -> None:
        async with stack(capacity_wait=20, max_capacity_waiters=1) as (router, _), \
                httpx.AsyncClient(timeout=20) as c:
            first = asyncio.create_task(c.post(router + "/generate", json=SHORT))
            await held(c, router, "colocated")
            t0 = time.monotonic()
            r = await c.post(router + "/generate", json=SHORT)
            assert r.status_code == 503 and time.monotonic() - t0 < 1
            assert "already holds 1 requests waiting for capacity" in r.json()["error"]["message"]
            assert await pending(c, router, "colocated") == 1  # the first one still waits
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)

            async def released() -> bool:
                return await pending(c, router, "colocated") == 0
            await until(released)

    run(test)


# ---- (e) the client goes away while held --------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_while_held_frees_its_slot(stream: bool) -> None:
    async def test() -> None:
        async with stack(1, capacity_wait=20, max_capacity_waiters=1) as (router, workers), \
                httpx.AsyncClient(timeout=20) as c:
            async def leaving() -> None:
                async with httpx.AsyncClient(timeout=20) as own:  # its own connection: closed on cancel
                    async with own.stream("POST", router + "/generate", json={**SHORT, "stream": stream}) as r:
                        await r.aread()

            task = asyncio.create_task(leaving())
            await held(c, router, "colocated")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

            async def released() -> bool:
                return await pending(c, router, "colocated") == 0
            await until(released)
            # The slot is free (max 1): a new request waits again instead of a 503 ...
            again = asyncio.create_task(c.post(router + "/generate", json=SHORT))
            await held(c, router, "colocated")
            w, url = workers[0]
            added = await c.post(router + "/workers", json={"url": url, "role": "colocated"}, headers=ADMIN)
            assert added.status_code == 200
            assert (await again).status_code == 200
            assert w.posts == 1  # ... and the one that left never reached a worker

    run(test)


# ---- (f) holding off -----------------------------------------------------------------------------------
def test_capacity_wait_zero_keeps_the_immediate_503() -> None:
    async def test() -> None:
        async with stack(capacity_wait=0) as (router, _), httpx.AsyncClient(timeout=20) as c:
            assert (await c.get(router + "/health/ready")).status_code == 503  # nothing to serve with
            t0 = time.monotonic()
            r = await c.post(router + "/generate", json=SHORT)
            assert r.status_code == 503 and time.monotonic() - t0 < 1
            assert r.json()["error"]["message"] == "no healthy colocated worker is available"
            assert await series(c, router, ROUTER_CAPACITY_WAITS_TOTAL, "colocated") == 0

    run(test)


# ---- the parts ------------------------------------------------------------------------------------------
def test_worker_set_wakes_waiters_on_change() -> None:
    async def test() -> None:
        ws = WorkerSet()
        waiter = asyncio.create_task(ws.changed(10))
        await asyncio.sleep(0.01)  # sleep-ok: the waiter must be parked before the change
        assert not waiter.done()
        ws.add(Worker("http://d:8000", DECODE))
        await asyncio.wait_for(waiter, 1)  # woken, long before its 10 s
        t0 = time.monotonic()
        await ws.changed(0.05)  # no change: back after the timeout
        assert time.monotonic() - t0 >= 0.04

    run(test)


def test_pd_comes_from_the_config() -> None:
    assert RouterConfig(prefill=(("http://p:8000", 8998),)).pd
    assert RouterConfig(selectors=((PREFILL, "app=p"), (DECODE, "app=d"))).pd
    assert not RouterConfig(workers=("http://w:8000",)).pd and not RouterConfig(selectors=((DECODE, "x"),)).pd
    with pytest.raises(ValueError):
        RouterConfig(capacity_wait=-1)
