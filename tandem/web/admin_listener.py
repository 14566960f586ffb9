"""The admin listener: a second uvicorn server on 127.0.0.1:--admin-port, beside the main one.

    main listener  (--host:--port)        every route; admin routes only with the admin key
    admin listener (127.0.0.1:admin port) admin routes, probes, GET /workers; no key asked

It serves the same app object (one state, one lifespan: the main server's), through a filter
that refuses every other route with 404 and marks the scope as the admin listener's for the
Guard (security.py). Being bound to loopback is what makes it trusted: only processes in the
pod reach it (the preStop hook, `kubectl exec`, `kubectl port-forward`), whatever a service
mesh does to the main listener's peers. Worker and router both run it; torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from tandem.web.errors import error_body
from tandem.web.security import ADMIN_LISTENER, ADMIN_LISTENER_ROUTES

ADMIN_HOST = "127.0.0.1"


class AdminListener:
    """The app as the admin listener serves it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if (scope["method"], scope["path"]) not in ADMIN_LISTENER_ROUTES:
                body = json.dumps(error_body(404, f"{scope['path']} is not served on the admin listener")).encode()
                await send({"type": "http.response.start", "status": 404,
                            "headers": [(b"content-type", b"application/json")]})
                return await send({"type": "http.response.body", "body": body})
            scope = {**scope, ADMIN_LISTENER: True}
        await self.app(scope, receive, send)


class _AdminServer(uvicorn.Server):
    """Leaves signals to the main server: it decides when the process stops (a worker drains first)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(port: int) -> socket.socket:
    """The admin socket, bound now: a port in use fails the start before a model loads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ADMIN_HOST, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"--admin-port {port}: cannot listen on {ADMIN_HOST}:{port}: {exc} (another server on this "
                         "host? give each its own --admin-port, or 0 for none)") from None
    sock.set_inheritable(True)
    return sock


def run(main: uvicorn.Server, app: Any, admin_port: int) -> None:
    """Run `main` (serving `app`) and, unless admin_port is 0, the admin listener, until `main` stops."""
    sock = bind(admin_port) if admin_port else None

    async def both() -> None:
        if sock is None:
            return await main.serve()
        admin = _AdminServer(uvicorn.Config(AdminListener(app), lifespan="off", log_level="warning",
                                            access_log=False, timeout_graceful_shutdown=5))
        task = asyncio.create_task(admin.serve(sockets=[sock]))
        try:
            await main.serve()
        finally:
            admin.should_exit = True
            await task

    with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
        runner.run(both())
