"""The decode worker's `x-prefiller-host-port` handling, in-process: whom it will send a prompt
to (only a --pd-prefill-peers address that says it is a prefill worker), what both workers get,
and the hostile headers (each a clear error; nothing is sent anywhere)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from router_fakes import run, serving
from waits import async_wait_until

from tandem.server.prefiller_header import PrefillerHeader


class Prefill:
    """A prefill worker's two routes the header path uses: /get_server_info and the prompt."""

    def __init__(self, role: str = "prefill") -> None:
        self.role, self.posts = role, []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        if scope["method"] == "POST":
            self.posts.append(json.loads(body))
        payload = json.dumps({"role": self.role, "bootstrap_port": 9999} if scope["method"] == "GET" else {}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


async def inner(scope: dict, receive: Any, send: Any) -> None:
    """The decode worker's routes: echo the body they were given."""
    msg = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": msg["body"]})


def _post(app: Any, header: str | None, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
            headers = {"x-prefiller-host-port": header} if header is not None else {}
            return await c.post("/generate", json=body, headers=headers)

    return asyncio.run(go())


def test_a_peer_prefill_worker_gets_the_same_body_with_the_bootstrap_fields() -> None:
    pre = Prefill()

    async def test() -> None:
        async with serving(pre) as url:
            host_port = url.removeprefix("http://")

            async def decode(scope: dict, receive: Any, send: Any) -> None:  # answers once prefill has the prompt
                await async_wait_until(lambda: pre.posts, 5, "the prefill call")
                await inner(scope, receive, send)

            app = PrefillerHeader(decode, peers="127.0.0.1:9999", api_key=None)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
                r = await c.post("/generate", json={"text": "hi", "stream": True},
                                 headers={"x-prefiller-host-port": host_port})
                got = r.json()
                assert (got["bootstrap_host"], got["bootstrap_port"]) == ("127.0.0.1", 9999)
                assert pre.posts[0] == {**got, "stream": False}

    run(test)


@pytest.mark.parametrize("header, peers, status", [
    ("10.0.0.9:8000", "127.0.0.1:9999", 400),   # not a peer: no prompt goes there
    ("nonsense", "127.0.0.1:9999", 400),
    ("127.0.0.1:99999", "127.0.0.1:9999", 400),
    ("127.0.0.1:8000", None, 400),             # no peers configured: no header taken
])
def test_hostile_headers_are_refused_before_anything_is_sent(header: str, peers: str | None, status: int) -> None:
    r = _post(PrefillerHeader(inner, peers=peers, api_key=None), header, {"text": "hi"})
    message = r.json()["error"]["message"]
    assert r.status_code == status and ("x-prefiller-host-port" in message or "pd-prefill-peers" in message)


def test_a_peer_that_is_not_a_prefill_worker_is_a_502() -> None:
    other = Prefill(role="decode")

    async def test() -> None:
        async with serving(other) as url:
            app = PrefillerHeader(inner, peers="127.0.0.1:9999", api_key=None)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
                r = await c.post("/generate", json={"text": "hi"},
                                 headers={"x-prefiller-host-port": url.removeprefix("http://")})
                assert r.status_code == 502 and not other.posts

    run(test)


def test_without_the_header_requests_pass_untouched() -> None:
    r = _post(PrefillerHeader(inner, peers="127.0.0.1:9999", api_key=None), None, {"text": "hi"})
    assert r.json() == {"text": "hi"}
