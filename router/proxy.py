"""Dispatch and retries: a request's path through the router.

    choose a worker (colocated) or a pair (PD) -> send -> what came back?
        connect error, connection lost before any byte,  -> back off (exponential, jittered),
        503 (draining or dead), 429 (busy)                  another worker/pair
        no status within the request timeout (600 s)     -> 504, not re-sent (it may still be working)
        any other status (a 500 included)                -> to the client as the worker sent it
    from the first byte of an answer on, no retry: a worker dying mid-answer is a 502, one
    dying mid-stream an SSE error event and [DONE] (router/relay.py)

A 500 is not retried: it is what this request did to a worker, and a request that crashes a
worker would crash the next one too. It still counts against the worker's breaker.

PD mode: the same body, plus bootstrap_host/port/room, goes to a prefill (non-streaming,
its answer read and dropped) and to a decode (streamed to the client). When the decode
worker is estimated to hold all but `local_prefill_threshold` tokens of the prompt, the
request goes to decode alone (conditional disaggregation; decode prefills it itself).

Load (requests, tokens) is held from dispatch until the last byte or a cancellation, on
every worker a request touches; a client that goes away closes the worker connections,
which aborts the request there (the workers free its pages).

No eligible worker for a role the request needs (a role scaled to zero, or all down): the
request is held (router/capacity.py) until one appears or `--capacity-wait` runs out. A
router configured for PD stays in PD mode with no prefill pod left, so a long prompt waits
for a prefill worker instead of silently being prefilled on decode.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response, StreamingResponse

from tandem.router.capacity import CapacityWait
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import Policy
from tandem.router.relay import relay
from tandem.router.reported import error_message, output_tokens, prompt_tokens
from tandem.router.upstream import Upstream, UpstreamError
from tandem.router.workers import COLOCATED, DECODE, PREFILL, Worker, WorkerSet
from tandem.web.errors import ApiError


@dataclass
class Job:
    path: str
    body: dict[str, Any]  # what the workers get
    ids: list[int]  # the routing key: the (first) prompt's token ids
    tokens: int  # load estimate: prompt + generation budget, all choices
    stream: bool
    choices: int = 1  # sequences it opens on a worker (prompts x n): its admission slots
    done: Callable[[], None] = lambda: None  # called once its answer is over (a stream: its last byte)
    # Returns once the client has gone; set for streams, whose wait for capacity nothing else cancels.
    disconnected: Callable[[], Awaitable[Any]] | None = None
    raw: bytes | None = None  # the client's body as it came, when `body` is it unchanged: sent as is
    # Worker URLs it may go to, None: any. A gateway's subset hint (router/epp/) narrows the pool
    # strictly: a request is never sent outside it, even when nothing in it is eligible.
    only: frozenset[str] | None = None

    def payload(self, body: dict[str, Any]) -> bytes:
        """`body` as bytes for a worker: the client's own bytes when it is the body they became."""
        if body is self.body and self.raw is not None:
            return self.raw
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(eq=False)
class Route:
    main: Worker  # the worker that answers the client (colocated or decode)
    body: dict[str, Any]
    prefill: Worker | None = None
    held: list[Worker] = field(default_factory=list)


RETRIED = (429, 503)  # statuses that say "not here, not now", never "not this request"


@dataclass(frozen=True)
class ProxyConfig:
    max_retries: int = 2
    backoff: float = 0.05
    local_prefill_threshold: int = 32
    # Configured for PD (prefill selector or list): PD even while no prefill pod exists.
    # False: PD whenever a prefill worker is known (one added over the admin API).
    pd: bool = False


class Proxy:
    def __init__(self, cfg: ProxyConfig, workers: WorkerSet, policies: dict[str, Policy],
                 metrics: RouterMetrics, client: Upstream, capacity: CapacityWait | None = None) -> None:
        self.cfg, self.workers, self.policies, self.metrics, self.client = cfg, workers, policies, metrics, client
        self.capacity = capacity if capacity is not None else CapacityWait(workers, metrics)  # default: off

    def pd_mode(self) -> bool:
        return self.cfg.pd or PREFILL in self.workers.roles()

    def needs_ids(self) -> bool:
        """Whether routing reads the prompt's token ids: cache_aware and token-load policies do,
        and PD does (how much of the prompt decode holds decides whether prefill is needed)."""
        return self.pd_mode() or self.policies[COLOCATED].reads_tokens

    async def handle(self, job: Job) -> Response:
        tried: set[str] = set()
        last = (503, "no healthy worker is available")
        deadline = time.monotonic() + self.capacity.timeout  # one budget for all attempts' waits
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                base = self.cfg.backoff * 2 ** (attempt - 1)
                await asyncio.sleep(min(2.0, base + random.uniform(0, base)))
            route = self._route(job, tried)
            if isinstance(route, str):
                if not attempt and not self.capacity.enabled:
                    last = (503, f"no healthy {route} worker is available")
                if not self.capacity.enabled or (attempt and time.monotonic() >= deadline):
                    break  # a retry past the budget answers with the failure it retried
                route = await self._await_capacity(job, tried, route, deadline)
            tried.update(w.url for w in (route.main, route.prefill) if w is not None)
            result = await self._attempt(job, route)
            if isinstance(result, Response):
                return result
            last = result
        raise ApiError(*last)

    # ---- choice ---------------------------------------------------------------------------------
    def _candidates(self, role: str, tried: set[str], only: frozenset[str] | None = None) -> list[Worker]:
        pool = self.workers.eligible(role)
        if only is not None:
            pool = [w for w in pool if w.url in only]
        fresh = [w for w in pool if w.url not in tried]
        return fresh or pool  # a retry prefers another worker, but one left is still one

    def choose(self, job: Job, tried: set[str]) -> Route | None:
        route = self._route(job, tried)
        return route if isinstance(route, Route) else None

    def _route(self, job: Job, tried: set[str]) -> Route | str:
        """A route, or the role that has no eligible worker for this request."""
        if not self.pd_mode():
            pool = self._candidates(COLOCATED, tried, job.only) or self._candidates(DECODE, tried, job.only)
            if not pool:
                return COLOCATED
            return Route(self._pick(COLOCATED, pool, job.ids)[0], job.body)
        decodes = self._candidates(DECODE, tried, job.only)
        if not decodes:
            return DECODE
        prefills = [p for p in self._candidates(PREFILL, tried) if p.bootstrap_port is not None]
        if not {p.generation for p in prefills} & {d.generation for d in decodes} and self._needs_prefill(decodes, job):
            return PREFILL  # decided before a pick: cache_aware would record the prompt as cached on decode
        d, matched = self._pick(DECODE, decodes, job.ids)
        if len(job.ids) - matched <= self.cfg.local_prefill_threshold:
            self.metrics.pd_decisions.labels("decode_alone").inc()
            return Route(d, job.body)
        same = [p for p in prefills if p.generation == d.generation]  # never pair across a rollout
        if not same:
            return PREFILL
        p, _ = self._pick(PREFILL, same, job.ids)
        self.metrics.pd_decisions.labels("disaggregated").inc()
        body = {**job.body, "bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": random.randrange(2**63 - 2**16)}  # room + i per choice stays < 2**63
        return Route(d, body, prefill=p)

    async def _await_capacity(self, job: Job, tried: set[str], role: str, deadline: float) -> Route:
        """Hold the request until a route exists (or a 503: timeout, too many held)."""
        async with self.capacity.hold(role, deadline, job.disconnected) as held:
            while True:
                await held.wait(role)
                if not self.capacity.ready(role):  # cheap: no policy pick (it has side effects) until it can work
                    continue
                route = self._route(job, tried)
                if isinstance(route, Route):
                    return route
                role = route  # e.g. a decode worker came, and this long prompt now needs a prefill one

    def _needs_prefill(self, decodes: list[Worker], job: Job) -> bool:
        """No decode worker is estimated to hold all but local_prefill_threshold of the prompt
        (the best match over them, read without a pick)."""
        policy = self.policies[DECODE if DECODE in self.policies else COLOCATED]
        best = 0
        if policy.name in ("cache_aware", "kv_events"):
            names = policy.index.names(job.ids)
            best = max(policy.index.match(d.url, names) for d in decodes) * policy.index.block
        return len(job.ids) - best > self.cfg.local_prefill_threshold

    def _pick(self, role: str, pool: list[Worker], ids: list[int]) -> tuple[Worker, int]:
        policy = self.policies[role if role in self.policies else COLOCATED]
        hits = policy.hits
        w, matched = policy.pick(pool, ids)
        if policy.name in ("cache_aware", "kv_events"):
            (self.metrics.cache_hits if policy.hits > hits else self.metrics.cache_misses).inc()
            self.metrics.matched_tokens.inc(matched)
        return w, matched

    # ---- one attempt ------------------------------------------------------------------------------
    def _hold(self, route: Route, job: Job) -> Callable[[], None]:
        route.held = [w for w in (route.main, route.prefill) if w is not None]
        for w in route.held:
            w.requests += 1
            w.tokens += job.tokens
            w.breaker.on_dispatch()

        def release() -> None:
            for w in route.held:
                w.requests -= 1
                w.tokens -= job.tokens
            route.held = []

        return release

    async def _prefill(self, route: Route, job: Job) -> None:
        assert route.prefill is not None  # invariant: called only for a route with a prefill
        p = route.prefill
        r = None
        try:
            r = await self.client.post(p.url + job.path, job.payload({**route.body, "stream": False}))
            await r.read()
            (p.breaker.on_fault if r.status >= 500 else p.breaker.on_success)()
        except (UpstreamError, TimeoutError):
            p.breaker.on_fault()
        finally:
            if r is not None:
                r.close()  # cancelled (the decode side ended first, or the client left): the worker aborts

    async def _attempt(self, job: Job, route: Route) -> Response | tuple[int, str]:
        """The answer, or (status, message) of a failure another worker may not have."""
        release = self._hold(route, job)
        prefill = asyncio.create_task(self._prefill(route, job)) if route.prefill is not None else None
        t0 = time.monotonic()
        streaming = False
        w = route.main
        try:
            try:
                resp = await self.client.post(w.url + job.path, job.payload(route.body))
            except UpstreamError as exc:  # not connected, or lost before a byte of an answer
                w.breaker.on_fault()
                return 503, f"worker {w.url} unreachable: {exc}"
            except TimeoutError:  # it may still be working on it: sent again, it would be done twice
                w.breaker.on_fault()
                raise ApiError(504, f"worker {w.url} did not answer within {self.client.read_timeout:.0f} s") from None
            if resp.status in RETRIED:
                try:
                    text = (await resp.read()).decode(errors="replace")
                except (UpstreamError, TimeoutError):
                    text = ""
                resp.close()
                if resp.status != 429:  # 429: busy, not broken
                    w.breaker.on_fault()
                return resp.status, error_message(text, resp.status)
            (w.breaker.on_fault if resp.status >= 500 else w.breaker.on_success)()
            media = resp.headers.get("content-type", "application/json")
            if not job.stream or not media.startswith("text/event-stream"):
                try:
                    content = await resp.read()
                except (UpstreamError, TimeoutError) as exc:  # a status came: no retry from here on
                    w.breaker.on_fault()
                    raise ApiError(502, f"worker {w.url} failed mid-answer: {type(exc).__name__}") from None
                finally:
                    resp.close()
                self.metrics.latency.observe(time.monotonic() - t0)
                self.metrics.generation_tokens.inc(output_tokens(content, 0))
                if not job.ids:  # not tokenized here: the worker's count
                    self.metrics.prompt_tokens.inc(prompt_tokens(content, 0))
                return Response(content, status_code=resp.status, media_type=media)
            streaming = True

            def finish() -> None:
                release()
                job.done()
                if prefill is not None and not prefill.done():
                    prefill.cancel()

            return StreamingResponse(relay(self.metrics, resp, w, t0, not job.ids, finish),
                                     status_code=resp.status, media_type=media)
        finally:
            if not streaming:  # the relay releases a stream when it ends
                release()
                if prefill is not None and not prefill.done():
                    prefill.cancel()
