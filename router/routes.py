"""The router's HTTP surface: OpenAI routes and /generate (validated with the workers' own
request models, tokenized once here), health, metrics, and the admin API for workers.

A proxied body loses ROUTER_FIELDS before anything else: PD's bootstrap_host/port/room are the
router's to set (they tell a decode worker which prefill worker to pull KV from), and a client
that picks its own `rid` could collide with, or abort, someone else's request on a worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from tandem.protocol.chat_api import ChatCompletionRequest
from tandem.protocol.openai_api import CompletionRequest, GenerateRequest
from tandem.router.proxy import Job
from tandem.router.worker_urls import parse_worker_url
from tandem.router.workers import COLOCATED, DECODE, PREFILL, Worker
from tandem.web.disconnect import cancel_on_disconnect
from tandem.web.errors import ApiError, bad_request, error_response
from tandem.worker_contract import DRAIN_PATH

router = APIRouter()
DEFAULT_BUDGET = 256  # load estimate for a request without max_tokens
ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")


def strip_router_fields(raw: object) -> bool:
    """Remove ROUTER_FIELDS from a body's top level; whether there were any."""
    if not isinstance(raw, dict):
        return False
    found = [k for k in ROUTER_FIELDS if k in raw]
    for k in found:
        del raw[k]
    return bool(found)


def _state(request: Request) -> Any:
    return request.app.state.router


def _check_model(state: Any, model: str) -> None:
    if state.model_name is not None and model != state.model_name:
        raise bad_request(f"the model {model!r} does not exist; this router serves {state.model_name!r}",
                          code="model_not_found", param="model")


async def run(request: Request, state: Any, job: Job) -> Response:
    state.metrics.prompt_tokens.inc(len(job.ids))
    peer = request.client.host if request.client else ""
    state.clients.acquire(peer)
    try:
        await state.admission.acquire(job.choices)
    except BaseException:
        state.clients.release(peer)
        raise

    def release() -> None:
        state.admission.release(job.choices)
        state.clients.release(peer)

    job.done = _once(release)  # a stream holds its slots until its last byte
    streaming = False
    try:
        if not job.stream:
            return await cancel_on_disconnect(request, state.proxy.handle(job))  # closes the worker connections
        job.disconnected = lambda: _disconnected(request)  # a stream held for capacity leaves when its client does
        response = await state.proxy.handle(job)
        streaming = isinstance(response, StreamingResponse)  # its relay calls job.done
        return response
    finally:
        if not streaming:
            job.done()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is read: nothing else arrives before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    called = False

    def once() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return once


CHARS_PER_TOKEN = 4  # a prompt's tokens estimated from its text, where it is not tokenized
INLINE_CHARS = 2048  # shorter texts tokenize in ~50 us: a thread hop would cost more than it saves


async def _tokens(state: Any, fn: Any, *args: Any) -> list[int]:
    try:
        if len(str(args)) <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)  # off the event loop: long prompts take ms
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None


# ---- the proxied routes: a request body becomes a Job (router/fast_path.py serves them) ----------
async def completion_job(state: Any, body: CompletionRequest, raw: dict) -> Job:
    _check_model(state, body.model)
    prompts = body.prompts()
    ids = [p if isinstance(p, list) else await _tokens(state, state.tokenizer.encode, p) for p in prompts]
    if not body.echo and state.tokenizer.real:  # workers get ids (echo needs the text as written)
        raw = {**raw, "prompt": ids[0] if len(ids) == 1 else ids}  # a new dict: not the client's bytes
    budget = body.max_tokens if body.max_tokens is not None else DEFAULT_BUDGET
    return Job("/v1/completions", raw, ids[0], sum(len(i) + budget for i in ids) * body.n, body.stream,
               choices=len(ids) * body.n)


async def chat_job(state: Any, body: ChatCompletionRequest, raw: dict) -> Job:
    """Routing keys on the prompt as the worker renders it, tools included; the output
    constraint (response_format, a forced tool choice) is not part of it."""
    _check_model(state, body.model)
    ids = await _tokens(state, state.tokenizer.chat, body.template_messages(), body.template_tools())
    budget = body.max_new_tokens or DEFAULT_BUDGET
    return Job("/v1/chat/completions", raw, ids, (len(ids) + budget) * body.n, body.stream, choices=body.n)


async def generate_job(state: Any, body: GenerateRequest, raw: dict) -> Job:
    """/generate goes to the workers as it came (text or ids). Text is tokenized only when routing
    reads ids (`Proxy.needs_ids`): with a load-only policy the worker's tokenization is the only
    one, and the proxy counts the prompt tokens from its answer (a Job with no ids)."""
    first, budget = body.prompts()[0], body.sampling_params.max_new_tokens
    if isinstance(first, list) or state.proxy.needs_ids():
        ids = first if isinstance(first, list) else await _tokens(state, state.tokenizer.encode, first)
        return Job("/generate", raw, ids, (len(ids) + budget) * len(body.prompts()), body.stream,
                   choices=len(body.prompts()))
    estimate = len(first) // CHARS_PER_TOKEN + budget  # load only: least_requests breaks ties on it
    return Job("/generate", raw, [], estimate * len(body.prompts()), body.stream, choices=len(body.prompts()))


PROXIED: dict[str, tuple[type[BaseModel], Callable[[Any, Any, dict], Awaitable[Job]]]] = {
    "/v1/completions": (CompletionRequest, completion_job),
    "/v1/chat/completions": (ChatCompletionRequest, chat_job),
    "/generate": (GenerateRequest, generate_job),
}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    if state.model_name is None:  # no worker has named it yet (router/app.py asks again)
        return {"object": "list", "data": []}
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "owned_by": "tandem",
                                        "created": state.started}]}


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/health/ready")
async def ready(request: Request) -> Response:
    """Ready when a request can be served: a colocated worker, or a decode (and a prefill, in PD).
    Holding for capacity (--capacity-wait > 0), ready with no worker at all: a request that
    arrives is held while the operator scales up from zero, and without readiness the Service
    would have no endpoint, so no request, so no demand to scale on."""
    why = readiness(_state(request))
    return Response(status_code=200) if why is None else error_response(503, why)


def readiness(state: Any) -> str | None:
    """Why the router cannot serve a request now, or None (its HTTP front's and EPP's readiness)."""
    if state.draining:
        return "draining"
    ws = state.workers
    if state.proxy.capacity.enabled:
        return None
    if ws.eligible(COLOCATED) or (ws.eligible(DECODE) and (PREFILL not in ws.roles() or ws.eligible(PREFILL))):
        return None
    return "no healthy worker"


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    text = state.metrics.render(list(state.workers.workers.values()), len(state.admission.queue),
                                state.admission.inflight)
    return Response(text, media_type="text/plain; version=0.0.4")


@router.post(DRAIN_PATH)
async def drain(request: Request) -> dict[str, Any]:
    """preStop: readiness goes false (no new traffic from the Service), in-flight requests get
    up to 30 s to finish. New requests meanwhile still go through: the Service keeps sending
    some until the endpoint update lands."""
    state = _state(request)
    state.draining = True
    deadline = asyncio.get_running_loop().time() + 30
    while state.admission.inflight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return {"in_flight": state.admission.inflight}


# ---- admin: workers at run time -----------------------------------------------------------------
# POST /drain and POST/DELETE /workers answer only the admin listener or the admin key: the
# Guard's ADMIN_ROUTES (tandem/web/security.py) refuses everyone else with 403. A URL must
# also be a plain http://HOST:PORT the allowlist admits (router/worker_urls.py).
class WorkerBody(BaseModel):
    url: str = Field(max_length=300)
    role: str = Field(default=COLOCATED, pattern=f"^({COLOCATED}|{PREFILL}|{DECODE})$")
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    generation: str = ""


def _describe(w: Worker) -> dict[str, Any]:
    return {"url": w.url, "role": w.role, "bootstrap_port": w.bootstrap_port, "generation": w.generation,
            "healthy": w.healthy, "breaker": w.breaker.state, "requests": w.requests, "tokens": w.tokens}


@router.get("/workers")
async def list_workers(request: Request) -> dict[str, Any]:
    return {"workers": [_describe(w) for w in _state(request).workers.workers.values()]}


@router.post("/workers")
async def add_worker(body: WorkerBody, request: Request) -> dict[str, Any]:
    if body.role == PREFILL and body.bootstrap_port is None:
        raise bad_request("a prefill worker needs its bootstrap_port", param="bootstrap_port")
    state = _state(request)
    try:
        url = parse_worker_url(body.url)
    except ValueError as exc:
        raise bad_request(str(exc), param="url") from None
    if not state.url_allow.allows(url, state.workers.workers):
        raise ApiError(403, f"{url} is not an allowed worker address: the router registers only the workers its "
                            "command line or discovery configured, and hosts or networks in --worker-url-allow",
                       code="worker_not_allowed", param="url")
    w = state.workers.add(Worker(url, body.role, body.bootstrap_port, body.generation))
    await state.health.check(w)
    return _describe(w)


@router.delete("/workers")
async def remove_worker(url: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    w = state.workers.remove(url)
    if w is None:
        raise ApiError(404, f"no worker {url}", param="url")
    for p in state.proxy.policies.values():
        p.index.remove(w.url)
    return {"removed": w.url}
