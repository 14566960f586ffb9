"""The router's FastAPI app: state (workers, policies, proxy, admission, health checks,
metrics) built once, an HTTP client pool to the workers, and the routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI

from tandem.router import routes
from tandem.router.admission import Admission
from tandem.router.capacity import CapacityWait
from tandem.router.client_limit import ClientLimit
from tandem.router.config import RouterConfig
from tandem.router.discovery import PodDiscovery
from tandem.router.fast_path import FastPath
from tandem.router.health import HealthChecker
from tandem.router.kv_event_feed import EventFeed
from tandem.router.kv_event_index import EventIndex
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import make_policy
from tandem.router.proxy import Proxy, ProxyConfig
from tandem.router.tokenizer import ByteTokenizer, RouterTokenizer, load_tokenizer
from tandem.router.upstream import Upstream
from tandem.router.worker_urls import UrlAllow
from tandem.router.workers import COLOCATED, DECODE, PREFILL, Breaker, Worker, WorkerSet
from tandem.web import errors
from tandem.web.security import Guard

log = logging.getLogger("tandem.router")


@dataclass
class RouterState:
    config: RouterConfig
    tokenizer: RouterTokenizer | ByteTokenizer
    workers: WorkerSet
    proxy: Proxy
    admission: Admission
    health: HealthChecker
    metrics: RouterMetrics
    model_name: str | None
    clients: ClientLimit
    url_allow: UrlAllow  # what POST /workers may add
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False


def _workers(cfg: RouterConfig) -> WorkerSet:
    ws = WorkerSet()
    breaker = lambda: Breaker(cfg.breaker_threshold, cfg.breaker_cooldown)  # noqa: E731
    for url in cfg.workers:
        ws.add(Worker(url, COLOCATED, breaker=breaker()))
    for url, port in cfg.prefill:
        ws.add(Worker(url, PREFILL, port, breaker=breaker()))
    for url in cfg.decode:
        ws.add(Worker(url, DECODE, breaker=breaker()))
    return ws


async def _model_name(cfg: RouterConfig, ws: WorkerSet, client: httpx.AsyncClient) -> str | None:
    if cfg.model_name is not None:
        return cfg.model_name
    for w in ws.workers.values():
        try:
            return (await client.get(w.url + "/v1/models", timeout=5)).json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            continue
    return None


async def _learn_model_name(state: RouterState, client: httpx.AsyncClient, interval: float) -> None:
    """A router started before its workers (by hand, or a rollout) asks again until one answers:
    without this /v1/models named no model for the router's whole life."""
    while state.model_name is None:
        await asyncio.sleep(interval)
        state.model_name = await _model_name(state.config, state.workers, client)
    log.info("serving %r", state.model_name)


def _event_feed(cfg: RouterConfig, policies: dict[str, Any], ws: WorkerSet) -> EventFeed | None:
    """One subscription to the workers' KV events, shared by every kv_events policy."""
    users = [p for p in policies.values() if p.name == "kv_events"]
    if not users:
        return None
    index = EventIndex()
    for p in users:
        p.index = index
    return EventFeed(index, ws, cfg.kv_events_port, cfg.kv_events_port_offset, cfg.kv_events_replay,
                     cfg.kv_events_topic)


def build_app(cfg: RouterConfig) -> Any:
    """The ASGI app uvicorn serves: the guard (keys, body size), then the proxied routes' fast
    path, then FastAPI for everything else. The fast path sits outside FastAPI so that a
    proxied request skips FastAPI's whole middleware stack, not only its routing."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        session = Upstream(connect_timeout=5.0, read_timeout=cfg.request_timeout, api_key=cfg.worker_api_key)
        auth = {"Authorization": f"Bearer {cfg.worker_api_key}"} if cfg.worker_api_key else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout, connect=5.0), headers=auth) as client:
            ws = _workers(cfg)
            metrics = RouterMetrics()
            policies = {role: make_policy(name, threshold=cfg.cache_threshold, balance=cfg.balance)
                        for role, name in ((COLOCATED, cfg.policy), (PREFILL, cfg.prefill_policy),
                                           (DECODE, cfg.decode_policy))}
            feed = _event_feed(cfg, policies, ws)
            proxy = Proxy(ProxyConfig(cfg.max_retries, local_prefill_threshold=cfg.local_prefill_threshold,
                                      pd=cfg.pd),
                          ws, policies, metrics, session,
                          CapacityWait(ws, metrics, cfg.capacity_wait, cfg.max_capacity_waiters))
            health = HealthChecker(ws, client, cfg.health_interval, cfg.health_timeout, cfg.health_fail_threshold)
            await health.check_all()
            state = RouterState(cfg, load_tokenizer(cfg.tokenizer), ws, proxy,
                                Admission(cfg.max_inflight, cfg.max_queue, cfg.queue_timeout, cfg.rate_limit,
                                          cfg.burst),
                                health, metrics, await _model_name(cfg, ws, client),
                                ClientLimit(cfg.max_requests_per_client), cfg.url_allow)
            app.state.router = state
            tasks = [asyncio.create_task(health.run())]
            if feed is not None:
                tasks.append(asyncio.create_task(feed.run()))
            if state.model_name is None:
                tasks.append(asyncio.create_task(_learn_model_name(state, client, cfg.health_interval)))
            if cfg.selectors:
                discovery = PodDiscovery(ws, cfg.namespace, dict(cfg.selectors),
                                         on_remove=lambda url: [p.index.remove(url) for p in policies.values()])
                tasks.append(asyncio.create_task(discovery.run()))
            epp = None
            if cfg.epp_port:
                from tandem.router.epp.server import EppListener  # grpc only where a gateway asks

                epp = EppListener(state, cfg.host, cfg.epp_port, cfg.epp_fallbacks, cfg.max_request_bytes)
                await epp.start(cfg.health_interval)
            log.info("router ready: %d workers, serving %r", len(ws.workers), state.model_name)
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()
                if epp is not None:
                    await epp.stop()
                await session.close()

    app = FastAPI(title="tandem router", version="0.1.0", lifespan=lifespan)
    errors.install(app)
    app.include_router(routes.router)
    return Guard(FastPath(app, owner=app), api_key=cfg.api_key, max_bytes=cfg.max_request_bytes,
                 admin_key=cfg.admin_key, admin_port=cfg.admin_port)

