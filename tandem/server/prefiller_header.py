"""A decode worker that drives its own prefill: the `x-prefiller-host-port` header.

Behind a gateway with an Endpoint Picker (the router's, router/epp/, or llm-d's), the gateway
sends each request straight to the decode worker the EPP picked, and names the prefill worker
it paired in this header (llm-d's routing-sidecar convention). What the router does in its own
PD path happens here instead, in front of the decode worker's routes:

    POST /v1/completions | /v1/chat/completions | /generate, header H:P
      H an address of a --pd-prefill-peers peer?           no  -> 400 (a client does not choose
                                                                   where decode sends prompts)
      GET http://H:P/get_server_info: a prefill worker?    no  -> 502; its bootstrap port, cached
      body += bootstrap_host H, its bootstrap port, a fresh bootstrap_room
      POST the same body (not streamed) to http://H:P       in the background: prefill sends KV
      the decode worker's route answers the client         the prefill call is cancelled with it

Without the header, or on a worker that is not a decode worker, requests pass untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any

import httpx

from tandem.decode.allowlist import Allowlist, PeerAddress, Verdict, parse_peers
from tandem.web.errors import ApiError
from tandem.web.json_body import parse_json, read_body, replaying, reply_json

log = logging.getLogger("tandem.server")
HEADER = b"x-prefiller-host-port"
PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})
INFO_TTL = 60.0  # seconds a prefill worker's bootstrap port is trusted before it is asked again
PENDING_WAIT = 2.0  # seconds a peer name's DNS answer is awaited


class PrefillerHeader:
    def __init__(self, app: Any, peers: str | None, api_key: str | None, timeout: float = 600.0) -> None:
        self.app = app
        addresses = parse_peers(peers)
        self.allow = Allowlist(addresses) if addresses else None
        self.ports = sorted({a.port for a in addresses})
        self.timeout = timeout
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._info: dict[tuple[str, int], tuple[int, float]] = {}  # (host, port) -> (bootstrap port, until)
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        target = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PATHS:
            target = next((v for k, v in scope["headers"] if k == HEADER), None)
        if target is None:
            return await self.app(scope, receive, send)
        try:
            url, body, data = await self._prepare(target.decode("latin-1"), receive)
        except ApiError as exc:
            return await reply_json(send, exc.status, exc.body())
        prefill = asyncio.create_task(self._prefill(url + scope["path"], body))
        headers = [(k, v) for k, v in scope["headers"] if k not in (HEADER, b"content-length")]
        headers.append((b"content-length", str(len(data)).encode()))
        replay = replaying(data, receive)
        try:
            await self.app({**scope, "headers": headers}, replay, send)
        finally:
            if not prefill.done():
                prefill.cancel()  # the answer ended first (client gone, an error): the prefill is aborted

    async def _prepare(self, target: str, receive: Any) -> tuple[str, dict[str, Any], bytes]:
        """The prefill worker's URL, the body both workers get, and its bytes."""
        host, port = _host_port(target)
        await self._check_peer(host)
        whole = await read_body(receive)
        if whole is None:
            raise ApiError(400, "the client left before its body was whole")
        raw = parse_json(whole)
        if not isinstance(raw, dict):
            raise ApiError(400, "the request body must be a JSON object")
        bootstrap = await self._bootstrap_port(host, port)
        body = {**raw, "bootstrap_host": host, "bootstrap_port": bootstrap,
                "bootstrap_room": random.randrange(2**63 - 2**16)}  # room + i per choice stays < 2**63
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        return f"http://{PeerAddress(host, port).key}", body, data

    async def _check_peer(self, host: str) -> None:
        if self.allow is None:
            raise ApiError(400, "this worker has no --pd-prefill-peers: it takes no x-prefiller-host-port header")
        deadline = time.monotonic() + PENDING_WAIT
        while True:
            verdicts = {self.allow.check(host, p)[0] for p in self.ports}
            if Verdict.ALLOWED in verdicts:
                return
            if Verdict.PENDING not in verdicts or time.monotonic() >= deadline:
                raise ApiError(400, f"x-prefiller-host-port {host[:80]!r} is not a prefill peer of this decode "
                                    "worker (--pd-prefill-peers)", param="x-prefiller-host-port")
            await asyncio.sleep(0.05)  # its peer names are being resolved

    async def _bootstrap_port(self, host: str, port: int) -> int:
        known = self._info.get((host, port))
        if known is not None and known[1] > time.monotonic():
            return known[0]
        where = f"http://{PeerAddress(host, port).key}"
        try:
            r = await self._http().get(where + "/get_server_info", timeout=5.0)
            info = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            raise ApiError(502, f"prefill worker {where} did not answer: {type(exc).__name__}") from None
        bootstrap = info.get("bootstrap_port") if isinstance(info, dict) else None
        if not isinstance(info, dict) or info.get("role") != "prefill" or not isinstance(bootstrap, int) \
                or not 0 < bootstrap < 65536:
            raise ApiError(502, f"{where} is not a prefill worker (its /get_server_info says otherwise)")
        self._info[(host, port)] = (bootstrap, time.monotonic() + INFO_TTL)
        return bootstrap

    async def _prefill(self, url: str, body: dict[str, Any]) -> None:
        try:
            r = await self._http().post(url, json={**body, "stream": False}, timeout=self.timeout)
            if r.status_code >= 400:
                log.warning("prefill %s answered %d: %s", url, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            log.warning("prefill %s failed: %s", url, type(exc).__name__)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self._auth)
        return self._client


def _host_port(target: str) -> tuple[str, int]:
    """The header's one host:port, read as --pd-prefill-peers entries are."""
    try:
        peers = parse_peers(target)
    except ValueError:
        peers = []
    if len(peers) != 1:
        raise ApiError(400, f"x-prefiller-host-port {target[:80]!r} is not host:port", param="x-prefiller-host-port")
    return peers[0].host, peers[0].port


