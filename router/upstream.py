"""The router's HTTP/1.1 client to its workers: pooled keep-alive connections, one write per
request, httptools (C) parsing the answers.

aiohttp was the proxy's client until it was measured: between the proxy asking for a request
and the request reaching the socket it ran ~190 us of Python (URL objects, header multidicts,
tracing hooks, a task to write the body), and as much again reading the answer; per proxied
request that was a third of the router's added latency. Workers are ours or SGLang's and speak
plain HTTP/1.1 on a private network, so the client needs little: POST a JSON body, read the
status and headers, then the body whole or as it arrives (Content-Length or chunked; httptools
decodes both), with a connect timeout and a per-read timeout.

Pool: idle connections per (host, port), last used first. One that the worker closed while
idle leaves the pool when the close arrives; one that closes in the instant it is reused fails
before a byte of the answer, which is retried once on a fresh connection (the worker cannot
have read a request on a connection it had already closed). Closing an answer before its end
closes the connection: that is how a client's disconnect reaches the worker, which aborts the
request and frees its pages.

The request target is the URL's path exactly as written: a worker URL is http://HOST:PORT
(router/worker_urls.py) plus the router's own path, and a URL with a `?`, `#`, `@`, space or
control character is refused here too rather than parsed into a query or another host. With
a worker key set (--worker-api-key), every request carries `Authorization: Bearer <key>`; the
client's own headers never reach a worker.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections import deque
from collections.abc import AsyncIterator

import httptools

HIGH_WATER = 1 << 20  # bytes of unread answer before the socket stops being read


class UpstreamError(Exception):
    """The worker could not be reached, or the connection broke before the answer was whole."""


class _Lost(UpstreamError):
    """The worker closed the connection."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, pool: Upstream, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: UpstreamResponse | None = None
        self.closed = False

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.answer is not None and not self.answer.complete:
            self._fail(_Lost("the worker closed the connection" + (f": {exc}" if exc else "")))

    # ---- httptools callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._headers: dict[str, str] = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.answer is not None:
            self.answer._start(self.parser.get_status_code(), self._headers)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._feed(body)

    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        keep = self.parser.should_keep_alive()
        if answer is not None:
            answer._finish(self if keep else None)
        if not keep:
            self.close()

    # ---------------------------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        answer, self.answer = self.answer, None
        if answer is not None:
            answer._error(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """An answer: its status and headers once `Upstream.post` returns, then its body."""

    def __init__(self, conn: _Connection, read_timeout: float) -> None:
        self._conn: _Connection | None = conn
        self._timeout = read_timeout
        self._loop = asyncio.get_running_loop()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._exc: Exception | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.started = self.complete = False

    # ---- fed by the connection ---------------------------------------------------------------------
    def _start(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers, self.started = status, headers, True
        self._wake()

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and self._conn is not None and self._conn.transport is not None:
            self._conn.transport.pause_reading()  # a slow client: the worker's writes back up, not our memory
        self._wake()

    def _finish(self, reusable: _Connection | None) -> None:
        self.complete = True
        if reusable is not None:
            reusable.pool._give_back(reusable)
        self._conn = None
        self._wake()

    def _error(self, exc: Exception) -> None:
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        if self._exc is not None:
            raise self._exc
        self._waiter = self._loop.create_future()
        try:
            async with asyncio.timeout(self._timeout):
                await self._waiter
        finally:
            self._waiter = None
        if self._exc is not None:
            raise self._exc

    # ---- read by the proxy -------------------------------------------------------------------------
    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives, each piece as soon as it is there."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                self._resume()
                yield data
            elif self.complete:
                return
            else:
                await self._wait()

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_any()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _resume(self) -> None:
        if self._buffered > HIGH_WATER and self._conn is not None and self._conn.transport is not None:
            self._conn.transport.resume_reading()
        self._buffered = 0

    def close(self) -> None:
        """Done with it: a whole answer's connection is already back in the pool; one cut short
        is closed, which the worker sees as its client leaving."""
        if not self.complete and self._conn is not None:
            self._conn.answer = None
            self._conn.close()
        self._conn = None


_URL = re.compile(r"http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?(/[A-Za-z0-9._~!$&'()*+,;=:%/-]*)")


@functools.lru_cache(maxsize=4096)
def _target(url: str, content_type: str) -> tuple[tuple[str, int], bytes]:
    """(host, port) and the request's head up to its length, per URL: a worker's few routes are
    parsed once, not on every request. The path is taken as written, never split into a query."""
    m = _URL.fullmatch(url)
    if m is None:
        raise UpstreamError(f"not a worker URL plus a path: {url!r}")
    host, port, path = m.group(1), int(m.group(2) or 80), m.group(3)
    netloc = host + (f":{m.group(2)}" if m.group(2) else "")
    start = f"POST {path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: {content_type}\r\n"
    return (host.strip("[]"), port), start.encode("latin-1")


class Upstream:
    def __init__(self, connect_timeout: float = 5.0, read_timeout: float = 600.0, api_key: str | None = None) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._auth = f"Authorization: Bearer {api_key}\r\n".encode("latin-1") if api_key else b""
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def post(self, url: str, body: bytes, content_type: str = "application/json") -> UpstreamResponse:
        """Send; return once the answer's status and headers are in."""
        key, start = _target(url, content_type)
        request = start + self._auth + b"Content-Length: %d\r\n\r\n" % len(body) + body
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            try:
                return await self._send(conn, request)
            except _Lost:
                break  # closed by the worker (idle) as we reused it: it never read the request
        return await self._send(await self._connect(key), request)

    async def _send(self, conn: _Connection, request: bytes) -> UpstreamResponse:
        answer = UpstreamResponse(conn, self.read_timeout)
        conn.answer = answer
        assert conn.transport is not None  # invariant: _connect returns a connected transport
        conn.transport.write(request)  # one segment: the worker wakes once
        try:
            while not answer.started:
                await answer._wait()
            return answer
        except BaseException:  # broken, a timeout, or the proxy cancelled: this connection is done
            answer.close()
            raise

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), *key)
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from None
        except TimeoutError:  # nothing was sent: as retryable as a refused connection
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: no answer in {self.connect_timeout} s") from None
        self._open.add(conn)
        return conn

    def _give_back(self, conn: _Connection) -> None:
        if not conn.closed:
            self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
