"""uvicorn's httptools protocol, with the writes of one event-loop turn sent as one.

uvicorn writes a response's status line and headers the moment the app sends
`http.response.start`, then the body on `http.response.body`: two send() calls, two TCP
segments, and the client wakes twice for one small JSON answer. On loopback the kernel runs the
receiver's side of each segment inside the sender's send(), so each costs tens of microseconds
of the sender's critical path, more on a VM. Rust proxies (hyper) write both in one vectored
write. Here the transport buffers what is written during one turn of the loop and flushes it in
a callback scheduled for the same turn's end: a whole small response leaves in one send(), and a
stream's chunks still leave as soon as the app yields control (no timer, no added latency).

A client that stops reading is cut off: once its socket and the transport's buffer are full
(asyncio's pause_writing) and stay full for `stall_timeout` seconds, the connection is aborted.
Without this a streaming client that never reads holds its request, its admission slot and its
pages on the worker forever; the abort is a disconnect to the app, which aborts the request.

Torch-free: the router and the worker server both use it (`uvicorn.Config(http=http_protocol())`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class CoalescingTransport:
    """A transport whose write() calls within one loop turn reach the socket as one write."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for c in chunks:
            self.write(c)

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()  # uvicorn closes right after the last body write of a non-keep-alive response
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, abort, ...
        return getattr(self._transport, name)


class StallTimer:
    """Aborts a transport whose writes stay paused (the peer reads nothing) for `timeout` s."""

    cut = 0  # connections cut off in this process (logged, and read by tests)

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop, self.timeout = loop, timeout
        self.handle: asyncio.TimerHandle | None = None

    def paused(self, transport: asyncio.BaseTransport) -> None:
        if self.handle is None and self.timeout > 0:
            self.handle = self.loop.call_later(self.timeout, self._fire, transport)

    def resumed(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _fire(self, transport: asyncio.BaseTransport) -> None:
        self.handle = None
        if not transport.is_closing():
            StallTimer.cut += 1
            log.warning("a client read nothing for %.0f s: its connection is closed (%d so far)", self.timeout,
                        StallTimer.cut)
            transport.abort()  # type: ignore[attr-defined]


DEFAULT_STALL_TIMEOUT = 60.0


def http_protocol(stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> type[asyncio.Protocol] | str:
    """The protocol class for uvicorn's `http=`: httptools with coalesced writes and the stall
    timeout, or uvicorn's choice where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.stall = StallTimer(self.loop, stall_timeout)
            self.raw_transport = transport
            super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

        def pause_writing(self) -> None:
            super().pause_writing()
            self.stall.paused(self.raw_transport)

        def resume_writing(self) -> None:
            self.stall.resumed()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stall.resumed()
            super().connection_lost(exc)

    return CoalescingHttpToolsProtocol
