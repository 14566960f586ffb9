"""One request's route, picked for a gateway: the router's own front half without the proxying.

    method, path, headers, body  --(a proxied POST)--> parse, strip the router's fields, validate,
                                                       tokenize: the same Job the HTTP front builds
                                 --(anything else)---> a Job with no prompt (load alone decides)
    Job --admission (slots, queue)--> Proxy's route (policies, PD pairing, capacity wait)
        --> Pick: the endpoint, its fallbacks, the paired prefill, the body to forward
            (the client's bytes unless a router-only field was stripped), and `release`,
            which gives back the slots and the workers' load once the gateway's stream ends
        or an ApiError: the status and OpenAI error JSON the gateway answers with itself

The client's key is checked here as the HTTP front checks it (the gateway carries the client's
Authorization header), and replaced by the workers' key on the way out.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tandem.router import routes
from tandem.router.proxy import Job, Route
from tandem.router.workers import Worker
from tandem.web.errors import ApiError, validation_message
from tandem.web.json_body import parse_json


def endpoint(w: Worker) -> str:
    """A worker as GIE names an endpoint: host:port ([v6]:port), the URL's authority."""
    return urlsplit(w.url).netloc


@dataclass
class Pick:
    endpoint: str  # primary, then fallbacks: "ip:port,ip:port"
    prefill: str | None  # PD: the paired prefill worker's host:port
    body: bytes | None  # the body to forward in its place, None: the client's as it came
    headers: dict[str, str] = field(default_factory=dict)  # set on the forwarded request
    release: Callable[[], None] = lambda: None
    report: Callable[[int], None] = lambda status: None  # the answer's HTTP status, for the breaker


class Picker:
    def __init__(self, state: Any, fallbacks: int = 0) -> None:
        self.state = state  # the router's RouterState (router/app.py)
        self.fallbacks = fallbacks
        self._client_key = f"Bearer {state.config.api_key}".encode() if state.config.api_key else None
        key = state.config.worker_api_key
        self._worker_auth = {"authorization": f"Bearer {key}"} if key else {}

    async def pick(self, method: str, path: str, headers: dict[str, str], body: bytes | None,
                   only: frozenset[str] | None) -> Pick:
        """The route, or ApiError (the status the gateway answers with)."""
        t0 = time.monotonic()
        self._check_key(headers)
        job, forwarded = await self._job(method, path, body)
        job.only = self._urls(only)
        state = self.state
        await state.admission.acquire(job.choices)
        try:
            route = await self._route(job)
        except BaseException:
            state.admission.release(job.choices)
            raise
        release_load = state.proxy._hold(route, job)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                release_load()
                state.admission.release(job.choices)

        state.metrics.prompt_tokens.inc(len(job.ids))
        state.metrics.epp_seconds.observe(time.monotonic() - t0)

        def report(status: int) -> None:
            if status >= 500:
                route.main.breaker.on_fault()
            elif status != 429:
                route.main.breaker.on_success()

        return Pick(self._endpoints(route, job), endpoint(route.prefill) if route.prefill else None, forwarded,
                    dict(self._worker_auth), release, report)

    def _check_key(self, headers: dict[str, str]) -> None:
        if self._client_key is not None and not hmac.compare_digest(
                headers.get("authorization", "").encode(), self._client_key):
            raise ApiError(401, "missing or invalid API key: send Authorization: Bearer <key>",
                           code="invalid_api_key")

    async def _job(self, method: str, path: str, body: bytes | None) -> tuple[Job, bytes | None]:
        """The Job, and the body to forward in place of the client's (None: the client's bytes).
        The client's own body goes on, less the router's fields: a builder's tokenized copy is
        the HTTP front's optimisation, and workers take text as well."""
        entry = routes.PROXIED.get(path)
        if entry is None or method != "POST" or body is None:  # models, health, a body not waited for:
            return Job(path, {}, [], 0, False), None          # load alone decides
        model, build = entry
        raw = parse_json(body)
        stripped = routes.strip_router_fields(raw)
        try:
            validated = model.model_validate(raw)
        except ValidationError as exc:
            message, param = validation_message(RequestValidationError(exc.errors()))
            raise ApiError(400, message, "invalid_request", param) from None
        job = await build(self.state, validated, raw)
        return job, (json.dumps(raw, separators=(",", ":"), ensure_ascii=False).encode() if stripped else None)

    def _urls(self, only: frozenset[str] | None) -> frozenset[str] | None:
        if only is None:
            return None
        return frozenset(w.url for w in self.state.workers.workers.values() if endpoint(w) in only)

    async def _route(self, job: Job) -> Route:
        proxy = self.state.proxy
        route = proxy._route(job, set())
        if isinstance(route, Route):
            return route
        if job.only is not None or not proxy.capacity.enabled:
            raise ApiError(503, f"no healthy {route} worker is available"
                                + (" in the gateway's endpoint subset" if job.only is not None else ""))
        return await proxy._await_capacity(job, set(), route, time.monotonic() + proxy.capacity.timeout)

    def _endpoints(self, route: Route, job: Job) -> str:
        """The primary, then up to `fallbacks` others of its role by load (no prefix scoring:
        a fallback is used only when the primary fails)."""
        first = endpoint(route.main)
        if not self.fallbacks:
            return first
        others = [w for w in self.state.proxy._candidates(route.main.role, {route.main.url}, job.only)
                  if w is not route.main]
        others.sort(key=lambda w: (w.requests, w.tokens))
        return ",".join([first, *(endpoint(w) for w in others[:self.fallbacks])])

