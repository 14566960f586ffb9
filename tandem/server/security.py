"""API key, admin access and request-size limits, as one ASGI middleware in front of every route.

With a key set, every route but the probes and the metrics scrape needs
`Authorization: Bearer <key>` (compared in constant time). Bodies over the limit
are refused with 413 whether or not they declare a Content-Length.

The state-changing admin routes (ADMIN_ROUTES: the worker's drain, cache flush and abort,
the router's drain and worker add/remove) answer only the pod itself (a loopback peer: the
preStop hook, `kubectl exec`, `kubectl port-forward`) or a request carrying the key; with no
key set, only the pod itself. Reaching port 8000 from another pod is not enough to take a
worker out of service. The worker and the router share this module, so it stays torch-free.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

from tandem.server.errors import error_body
from tandem.worker_contract import DRAIN_PATH, HEALTH_PATH, METRICS_PATH, READY_PATH

OPEN_PATHS = frozenset({HEALTH_PATH, READY_PATH, METRICS_PATH})
# (method, path) of every state-changing admin route, the worker's and the router's;
# tests/server/test_admin_access.py checks both route tables against this set.
ADMIN_ROUTES = frozenset({
    ("POST", DRAIN_PATH), ("POST", "/flush_cache"), ("POST", "/abort_request"),  # worker (and router drain)
    ("POST", "/workers"), ("DELETE", "/workers"),  # router
})
# Exactly the two addresses the pod's own clients use, not all of 127.0.0.0/8: Istio's sidecar
# relays inbound traffic from 127.0.0.6, which would make every remote caller look local.
_LOOPBACK = frozenset({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")})
# A loopback peer that forwards for someone else (a local proxy or sidecar) is not the pod itself.
# The headers are never read for an address: any client can write them.
_FORWARDED = (b"x-forwarded-for", b"forwarded", b"x-real-ip")


def is_loopback_peer(scope: dict, headers: dict[bytes, bytes]) -> bool:
    """The TCP peer is this pod itself and no proxy relayed the request."""
    client = scope.get("client")
    if not client or any(h in headers for h in _FORWARDED):
        return False
    try:
        ip = ipaddress.ip_address(str(client[0]).split("%", 1)[0])
    except ValueError:  # a unix socket, or a test client's made-up name
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # a dual-stack listener
        ip = ip.ipv4_mapped
    return ip in _LOOPBACK


def admin_refusal(scope: dict, headers: dict[bytes, bytes], key: bytes | None) -> str | None:
    """Why an admin route refuses this request, or None when it may go on: a loopback peer,
    or the configured key (`key` is the whole expected header value, b"Bearer <key>")."""
    if is_loopback_peer(scope, headers):
        return None
    if key is not None and hmac.compare_digest(headers.get(b"authorization", b""), key):
        return None
    where = f"{scope.get('method', '')} {scope.get('path', '')}".strip()
    local = "call it from inside the pod (http://127.0.0.1, e.g. through kubectl exec or kubectl port-forward)"
    if key is None:
        return (f"{where} is an admin endpoint: {local}; no API key is set, so remote callers are refused "
                "(start the server with --api-key or $TANDEM_API_KEY to allow them)")
    return f"{where} is an admin endpoint: {local}, or send the API key as Authorization: Bearer <key>"


def forbidden_body(message: str) -> dict:
    body = error_body(403, message, code="admin_only")
    body["error"]["type"] = "permission_error"  # errors._TYPES has no 403 entry; server_error would mislead
    return body


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
        if (scope.get("method"), scope["path"]) in ADMIN_ROUTES:
            refusal = admin_refusal(scope, headers, self.key)
            if refusal is not None:
                return await _send(send, 403, forbidden_body(refusal))
        elif self.key is not None and scope["path"] not in OPEN_PATHS:
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
    await _send(send, status, error_body(status, message))


async def _send(send: Any, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
