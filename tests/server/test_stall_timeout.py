"""A client that stops reading a stream is cut off after the stall timeout, and the app sees it
go (its stream generator is closed), so the work behind the stream can be aborted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from waits import wait_until

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

from tandem.local.plan import free_port  # noqa: E402
from tandem.web.coalesced_http import StallTimer, http_protocol  # noqa: E402


def _app(closed: threading.Event):
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def endless():
        try:
            while True:
                yield b"x" * 65536
                await asyncio.sleep(0)  # sleep-ok: one event-loop turn between chunks of an endless stream
        finally:
            closed.set()

    async def stream(request):
        return StreamingResponse(endless(), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream)])


@contextlib.contextmanager
def _serving(closed: threading.Event) -> Iterator[int]:
    """The endless-stream app under uvicorn with a 1 s stall timeout; yields its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(closed), host="127.0.0.1", port=port, log_level="error",
                                           http=http_protocol(stall_timeout=1.0)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 20, "uvicorn to start")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_client_that_stops_reading_is_cut_off() -> None:
    closed = threading.Event()
    with _serving(closed) as port:
        before = StallTimer.cut
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read a byte
        assert closed.wait(30), "the stalled stream was never closed"
        assert StallTimer.cut == before + 1
        sock.close()


def test_a_slow_but_reading_client_is_not_cut_off() -> None:
    closed = threading.Event()
    with _serving(closed) as port:
        before = StallTimer.cut
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        t_end = time.monotonic() + 3
        while time.monotonic() < t_end:  # reads steadily, a little at a time
            assert sock.recv(1 << 20)
            time.sleep(0.2)  # sleep-ok: a slow but steady reader: the stall timer must not cut it
        assert StallTimer.cut == before and not closed.is_set()
        sock.close()
