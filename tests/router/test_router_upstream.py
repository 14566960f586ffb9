"""The router's worker client (router/upstream.py) against raw asyncio servers whose bytes on the
wire the tests choose, and the coalescing transport both servers run (tandem/web/coalesced_http.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from waits import async_wait_until

from tandem.router.upstream import Upstream, UpstreamError
from tandem.web.coalesced_http import CoalescingTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _answer(body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return await reader.readexactly(length)


def _serve(handler: Handler, test: Callable[[str, dict], Awaitable[None]]) -> dict:
    """Run `test(url, stats)` against a server running `handler` per connection."""
    stats: dict = {"connections": 0}

    async def main() -> None:

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            stats["connections"] += 1
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await asyncio.wait_for(test(f"http://127.0.0.1:{port}", stats), 10)

    asyncio.run(main())
    return stats


def _echo(extra: str = "") -> Handler:
    """Answers every request on the connection with its own body (and `extra` headers)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(_answer(body, extra))
            await writer.drain()
    return handler


def _posts(n: int, pause: float = 0.0) -> Callable[[str, dict], Awaitable[None]]:
    """A test that posts `{}` n times on one client, each answer read whole, `pause` s apart."""
    async def test(url: str, stats: dict) -> None:
        up = Upstream()
        for _ in range(n):
            r = await up.post(url + "/x", b"{}")
            assert await r.read() == b"{}"
            r.close()
            await asyncio.sleep(pause)  # sleep-ok: idle time between requests on a pooled connection
        await up.close()
    return test


def test_keep_alive_reuses_one_connection_and_sends_the_body():
    async def test(url: str, stats: dict) -> None:
        up = Upstream()
        for i in range(3):
            r = await up.post(url + "/generate", b'{"i": %d}' % i)
            assert r.status == 200 and r.headers["content-type"] == "application/json"
            assert await r.read() == b'{"i": %d}' % i
            r.close()
        await up.close()

    assert _serve(_echo(), test)["connections"] == 1


def test_a_chunked_stream_arrives_piece_by_piece():
    release = None

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await release.wait()
            release.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)  # sleep-ok: the fake worker keeps the connection open after the body

    async def test(url: str, stats: dict) -> None:
        nonlocal release
        release = asyncio.Event()
        up = Upstream()
        r = await up.post(url + "/generate", b"{}")
        got = []
        async for chunk in r.iter_any():
            got.append(chunk)  # each piece before the server sends the next: nothing waits for the end
            release.set()
        assert got == [b"data: 1\n\n", b"data: 2\n\n"] and r.complete
        r.close()
        await up.close()

    _serve(handler, test)


def test_a_connection_the_worker_closed_while_idle_is_replaced():
    async def one_answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_answer(await _read_request(reader)))  # keep-alive by default, then closed anyway
        await writer.drain()

    # 0.05 s apart: the close arrives while the connection is idle in the pool.
    assert _serve(one_answer_then_close, _posts(3, pause=0.05))["connections"] == 3


def test_a_close_racing_the_reuse_is_retried_on_a_fresh_connection():
    async def answer_one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_answer(await _read_request(reader)))
        await writer.drain()
        await reader.read(1)  # the next request's first byte: the connection was reused, then it closes

    # The second request is lost on the first connection and answered on the second.
    assert _serve(answer_one_then_close, _posts(2))["connections"] == 2


def test_closing_an_unfinished_answer_closes_the_connection():
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"5\r\nhello\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)  # sleep-ok: an endless stream, one chunk per 10 ms
        except ConnectionError:
            pass
        finally:
            stats_ref["worker_saw_close"] = True

    stats_ref: dict = {}

    async def test(url: str, stats: dict) -> None:
        up = Upstream()
        r = await up.post(url + "/x", b"{}")
        async for _ in r.iter_any():
            break
        r.close()  # a client that left: the worker must see its connection go
        await async_wait_until(lambda: stats_ref.get("worker_saw_close"), 2, "the worker to see its connection close")
        await up.close()

    _serve(endless, test)


def test_errors_connect_timeout_and_malformed():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)  # sleep-ok: a worker that never answers

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)  # sleep-ok: garbage, then the connection held open

    async def timeout_test(url: str, stats: dict) -> None:
        up = Upstream(read_timeout=0.2)
        with pytest.raises(TimeoutError):
            await up.post(url + "/x", b"{}")
        await up.close()

    async def garbage_test(url: str, stats: dict) -> None:
        up = Upstream()
        with pytest.raises(UpstreamError, match="malformed"):
            await up.post(url + "/x", b"{}")
        await up.close()

    async def refused() -> None:
        up = Upstream()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await up.post("http://127.0.0.1:1/x", b"{}")

    _serve(silent, timeout_test)
    _serve(garbage, garbage_test)
    asyncio.run(refused())


def test_after_a_lost_reuse_the_retry_opens_a_fresh_connection():
    """Two pooled connections the worker has both dropped: the retry must not take the second."""
    async def answer_one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        await asyncio.sleep(0.05)  # sleep-ok: both first requests in flight at once: two connections
        writer.write(_answer(body))
        await writer.drain()
        await reader.read(1)

    async def test(url: str, stats: dict) -> None:
        up = Upstream()
        for r in await asyncio.gather(*(up.post(url + "/x", b"{}") for _ in range(2))):
            assert await r.read() == b"{}"
            r.close()
        r = await up.post(url + "/x", b"{}")
        assert await r.read() == b"{}"
        r.close()
        await up.close()

    assert _serve(answer_one_then_close, test)["connections"] == 3


def test_connection_close_is_not_pooled():
    assert _serve(_echo("connection: close\r\n"), _posts(2))["connections"] == 2


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_coalescing_transport_sends_one_turns_writes_as_one():
    async def main() -> None:
        raw = _Recorder()
        t = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        assert raw.writes == []  # nothing until the turn ends
        await asyncio.sleep(0)  # sleep-ok: the end of one event-loop turn
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        t.write(b"chunk")  # a later turn: its own write
        await asyncio.sleep(0)  # sleep-ok: the end of one event-loop turn
        assert raw.writes[-1] == b"chunk"
        t.write(b"last")
        t.close()  # what is pending leaves before the close
        assert raw.writes[-1] == b"last" and raw.closed
        assert t.get_extra_info("peername") == "info:peername"

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_generate_is_tokenized_only_when_routing_reads_ids(policy: str) -> None:
    """A load-only policy forwards /generate without tokenizing and counts the prompt tokens the
    worker reports (the fake worker: 8); cache_aware tokenizes (no model: UTF-8 bytes)."""
    import httpx
    from test_router_scale_from_zero import run, stack

    text = "tokenize me please"  # 18 bytes

    async def test() -> None:
        async with stack(1, workers=(0,), policy=policy) as (router, _), httpx.AsyncClient() as c:
            for _ in range(2):
                r = await c.post(router + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4}})
                assert r.status_code == 200, r.text
            metrics = (await c.get(router + "/metrics")).text
            counted = float(next(line.split()[-1] for line in metrics.splitlines()
                                 if line.startswith("tandem_router_prompt_tokens_total")))
            assert counted == 2 * (8 if policy == "round_robin" else len(text))

    run(test)
