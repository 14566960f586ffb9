"""In-process doubles for router tests: a fake worker that records what reaches it and answers
as told, and uvicorn serving apps (the router included) on sockets bound to free ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from tandem.router.app import build_app
from tandem.router.config import RouterConfig
from tandem.web.admin_listener import AdminListener


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeWorker:
    """Answers POSTs with `status` and `error` (an OpenAI error JSON) or a small success; a
    streaming request gets `chunks` SSE events (forever with chunks=None, `chunk_bytes` each).
    With `key`, every route needs `Authorization: Bearer <key>` (else 401)."""

    status: int = 200
    error: str = "boom"
    key: str | None = None
    chunks: int | None = 2
    chunk_bytes: int = 16
    gap: float = 0.0
    calls: list[Call] = field(default_factory=list)
    health_calls: list[dict[str, str]] = field(default_factory=list)
    streams_closed: int = 0

    @property
    def posts(self) -> list[Call]:
        return [c for c in self.calls if c.method == "POST"]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if scope["method"] == "GET":
            self.health_calls.append(headers)
        else:
            self.calls.append(Call(scope["method"], scope["path"], headers, body))
        if self.key is not None and headers.get("authorization") != f"Bearer {self.key}":
            return await _json(send, 401, {"error": {"message": "bad worker key", "type": "authentication_error"}})
        if scope["method"] == "GET":
            return await _json(send, 200, {"object": "list", "data": [{"id": "tiny"}]})
        if self.status != 200:
            return await _json(send, self.status, {"error": {"message": self.error, "type": "x", "code": self.status}})
        if json.loads(body).get("stream"):
            return await self._stream(receive, send)
        await _json(send, 200, {"text": "ok", "meta_info": {"prompt_tokens": 3, "completion_tokens": 2}})

    async def _stream(self, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        event = b"data: {\"text\": \"" + b"x" * self.chunk_bytes + b"\"}\n\n"
        gone = asyncio.create_task(receive())  # the body is read: the next message is the disconnect
        i = 0
        try:
            while (self.chunks is None or i < self.chunks) and not gone.done():
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await asyncio.sleep(self.gap)  # sleep-ok: a fake worker streaming at its configured pace
                i += 1
            if gone.done():
                self.streams_closed += 1  # cut short: the router closed the connection
                return
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            gone.cancel()


async def _json(send: Any, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(app: Any, lifespan: str = "off", **config: Any) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here, so no other process can take the port meanwhile
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=2,
                                           **config))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # it failed to start: raise why
            await asyncio.sleep(0.01)  # sleep-ok: poll interval while uvicorn starts (its `started` flag has no event)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@contextlib.asynccontextmanager
async def router(cfg: RouterConfig, admin: bool = False, **config: Any) -> AsyncIterator[tuple[str, str | None]]:
    """The router app on a free port (and, with `admin`, its admin listener on another)."""
    app = build_app(cfg)
    async with serving(app, lifespan="on", **config) as url:
        if not admin:
            yield url, None
            return
        async with serving(AdminListener(app)) as admin_url:
            yield url, admin_url


@contextlib.asynccontextmanager
async def fakes(*workers: FakeWorker) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serving(w)) for w in workers]


def run(test: Callable[[], Any], timeout: float = 30) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout))
