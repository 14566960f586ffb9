"""The worker's FastAPI app: routes, error handlers, the guard, and a lifespan that
loads the model (its scheduler processes) before the port opens and shuts them down
after it closes.

A worker whose scheduler dies does not linger answering 503: /health fails at once, the
server stops (in-flight requests get their 503) and the process exits with
SCHEDULER_DIED_EXIT, so that Kubernetes or `tandem up --restart` replaces it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI

from tandem.server import admin_routes, chat_routes, generate_routes, openai_routes, schedulers
from tandem.server.config import ServerConfig
from tandem.server.front import Front
from tandem.server.metrics import ServerMetrics
from tandem.server.prefiller_header import PrefillerHeader
from tandem.server.runtime import Runtime
from tandem.server.start_failure import reporting_lifespan
from tandem.server.tokenizer_load import load_tokenizer
from tandem.server.tokens import Tokens
from tandem.server.tools.registry import choose_format
from tandem.web import errors
from tandem.web.json_body import JsonBodies
from tandem.web.security import Guard
from tandem.worker_contract import DECODE

log = logging.getLogger("tandem.server")
SCHEDULER_DIED_EXIT = 70  # sysexits' EX_SOFTWARE


def build_app(config: ServerConfig, client_factory: schedulers.ClientFactory | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        t0 = time.monotonic()
        log.info("loading %s (%s role, dp_size %d)", config.model_path, config.role, config.engine.dp_size)
        metrics = ServerMetrics()
        # The tokenizer loads in a thread while the scheduler processes start: importing
        # transformers takes seconds, which they spend importing the same.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer_loaded = pool.submit(load_tokenizer, config.model_path)
            front = Front(client_factory or schedulers.on_demand(config), config.max_active, metrics.observe,
                          on_down=lambda: _stop_serving(app))
            try:
                tokenizer = tokenizer_loaded.result()
            except BaseException:
                front.shutdown()
                raise
        tool_format = choose_format(config.tool_call_parser, getattr(tokenizer, "chat_template", None))
        rt = app.state.runtime = Runtime(config, front, Tokens(tokenizer, front.info), metrics, tool_format)
        log.info("scheduler ready in %.1f s: %s", time.monotonic() - t0, front.info)
        log.info("tool calls in the %s format; reasoning parser: %s", tool_format, config.reasoning_parser)
        if config.standalone:
            await _warm_up(rt)
        rt.ready = True
        log.info("ready in %.1f s: serving %r on http://%s:%d", time.monotonic() - t0,
                 config.served_model_name, config.host, config.port)
        try:
            yield
        finally:
            died = front.error is not None  # read before the shutdown, which ends the ranks too
            log.info("shutting down the scheduler")
            front.shutdown()
            app.state.scheduler_died = died  # the server process exits SCHEDULER_DIED_EXIT (process.py)

    # A model that fails to load reaches the pod's termination message (start_failure.py).
    app = FastAPI(title="tandem worker", version="0.1.0", lifespan=reporting_lifespan(lifespan))
    errors.install(app)
    for r in (openai_routes.router, chat_routes.router, generate_routes.router, admin_routes.router):
        app.include_router(r)
    if config.role == DECODE:  # behind a gateway's EPP: the prefill it paired comes in a header
        app.add_middleware(PrefillerHeader, peers=config.engine.pd_prefill_peers, api_key=config.api_key)
    app.add_middleware(JsonBodies)  # inside the guard: a body is checked once it is let in
    app.add_middleware(Guard, api_key=config.api_key, max_bytes=config.max_request_bytes,
                       admin_key=config.admin_key, admin_port=config.admin_port)
    return app


def _stop_serving(app: FastAPI) -> None:
    """The scheduler died: ask the server process to stop (request_exit is process.py's)."""
    stop = getattr(app.state, "request_exit", None)
    if stop is not None:
        log.error("the scheduler died: stopping this worker, so that it is replaced")
        stop()


async def _warm_up(rt: Runtime) -> None:
    """One short generation, so the first user request pays no first-call costs."""
    t0 = time.monotonic()
    stream = rt.front.open([1, 2, 3, 4], {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    try:
        while not (await stream.next()).finished:
            pass
    finally:
        rt.front.close(stream)
    log.info("warm-up generation in %.2f s", time.monotonic() - t0)
