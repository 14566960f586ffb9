"""Probes, information, metrics and the admin commands.

    GET  /health            the scheduler process is alive (liveness)
    GET  /health_generate   a one-token generation succeeds (deep check)
    GET  /health/ready      loaded and admitting (readiness; false while draining)
    GET  /get_server_info, /get_model_info, /v1/models (in openai_routes)
    GET  /metrics           prometheus text
    GET  /debug/pool        each rank's KV pool: sizes, and when idle its integrity check
    POST /drain             stop admitting, finish or abort in-flight work, report, exit
    POST /flush_cache       drop the prefix cache (when idle) and check the pool is whole
    POST /abort_request     {"rid": ...}

The three POSTs change the worker's state: the Guard (security.py, ADMIN_ROUTES) lets them
through only on the admin listener (127.0.0.1:--admin-port, where the preStop hook calls
/drain; admin_listener.py) or with the admin key (--admin-key, never the API key): reaching
port 8000, from another pod or through a sidecar, is not enough to drain a worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from tandem.protocol.messages import FlushCacheReq
from tandem.server.runtime import Runtime
from tandem.web.errors import ApiError, error_response
from tandem.worker_contract import COLOCATED, DECODE, DRAIN_PATH, HEALTH_PATH, METRICS_PATH, READY_PATH

router = APIRouter()


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


@router.get(HEALTH_PATH)
async def health(request: Request) -> Response:
    rt = _rt(request)
    if rt.front.error is not None:
        return error_response(503, f"the scheduler stopped: {rt.front.error!r}")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    rt = _rt(request)
    if not rt.config.standalone:
        return await health(request)
    stream = rt.front.open([rt.tokens.vocab_size // 2], {"max_new_tokens": 1, "temperature": 0.0})
    try:
        while not (await asyncio.wait_for(stream.next(), 20)).finished:
            pass
    except TimeoutError:
        return error_response(503, "no token within 20 s")
    finally:
        rt.front.close(stream)
    return Response(status_code=200)


@router.get(READY_PATH)
async def ready(request: Request) -> Response:
    rt = _rt(request)
    if not rt.ready or rt.front.draining or rt.front.error is not None:
        return error_response(503, "draining" if rt.front.draining else "not ready")
    if rt.config.role == DECODE:  # ready once a prefill peer's handshake holds (re-checked by heartbeats)
        pools = await rt.front.pool_state()
        if not all(p["pd"]["ready"] for p in pools):
            return error_response(503, "no prefill peer handshake yet: " + str([p["pd"]["peers"] for p in pools]))
    return Response(status_code=200)


@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    rt = _rt(request)
    engine = dataclasses.asdict(rt.config.engine)
    return {**engine, "model_path": rt.config.model_path, "served_model_name": rt.config.served_model_name,
            "role": rt.config.role, "disaggregation_mode": "null" if rt.config.role == COLOCATED else rt.config.role,
            "host": rt.config.host, "port": rt.config.port, "bootstrap_port": rt.config.bootstrap_port,
            "limits": rt.front.info, "version": "tandem-0.1.0"}


@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    rt = _rt(request)
    return {"model_path": rt.config.model_path, "tokenizer_path": rt.config.model_path,
            "served_model_name": rt.config.served_model_name, "is_generation": True,
            "max_context_len": rt.tokens.max_context_len}


@router.get(METRICS_PATH)
async def metrics(request: Request) -> Response:
    rt = _rt(request)
    return Response(rt.metrics.render(await rt.front.pool_state()), media_type="text/plain; version=0.0.4")


@router.get("/debug/pool")
async def pool(request: Request) -> dict[str, Any]:
    pools = await _rt(request).front.pool_state()
    for p in pools:
        p.pop("metrics", None)
    whole = [p["whole"] for p in pools]
    return {"whole": None if None in whole else all(whole), "ranks": pools}


def _exit(request: Request) -> None:
    stop = getattr(request.app.state, "request_exit", None)  # set by the server process
    if stop is not None:
        stop()


class DrainBody(BaseModel):
    timeout: float | None = Field(default=None, ge=0, le=3600)


@router.post(DRAIN_PATH)
async def drain(request: Request, body: DrainBody | None = None) -> JSONResponse:
    rt = _rt(request)
    if rt.front.draining:
        raise ApiError(503, "already draining")
    timeout = body.timeout if body and body.timeout is not None else rt.config.drain_timeout
    report = await rt.front.drain(timeout)
    return JSONResponse(report, background=BackgroundTask(_exit, request))


@router.post("/flush_cache")
async def flush_cache(request: Request) -> JSONResponse:
    replies = await _rt(request).front.admin(FlushCacheReq)
    ok = all(r.ok for r in replies)
    return JSONResponse({"ok": ok, "ranks": [{**r.info, "ok": r.ok} for r in replies]}, status_code=200 if ok else 409)


class AbortBody(BaseModel):
    rid: str = Field(min_length=1)


@router.post("/abort_request")
async def abort_request(body: AbortBody, request: Request) -> dict[str, Any]:
    return {"rid": body.rid, "aborted": _rt(request).front.abort(body.rid)}
