"""API key and request-size limits, as one ASGI middleware in front of every route.

With a key set, every route but the probes and the metrics scrape needs
`Authorization: Bearer <key>` (compared in constant time). Bodies over the limit
are refused with 413 whether or not they declare a Content-Length.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from tandem.server.errors import error_body
from tandem.worker_contract import HEALTH_PATH, METRICS_PATH, READY_PATH

OPEN_PATHS = frozenset({HEALTH_PATH, READY_PATH, METRICS_PATH})


class TooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: Any, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] not in OPEN_PATHS:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
                return await _reply(send, 401, "a valid API key is required (Authorization: Bearer <key>)")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _reply(send, 413, f"the body is over the {self.max_bytes}-byte limit")
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise TooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except TooLarge:
            await _reply(send, 413, f"the body is over the {self.max_bytes}-byte limit")


async def _reply(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
