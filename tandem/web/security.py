"""API key, admin key and request-size limits, as one ASGI middleware in front of every route.

With an API key set, every route but the probes and the metrics scrape needs
`Authorization: Bearer <api key>` (compared in constant time). Bodies over the limit
are refused with 413 whether or not they declare a Content-Length.

The state-changing admin routes (ADMIN_ROUTES: the worker's drain, cache flush and abort,
the router's drain and worker add/remove) are for operators, not inference clients:

    admin listener (127.0.0.1:--admin-port, tandem/web/admin_listener.py)   let in
    main listener with `Authorization: Bearer <admin key>` (--admin-key)        let in
    main listener, anything else (the API key, a loopback peer)                 403

Loopback is not trusted on the main listener: behind a service mesh sidecar every caller
arrives from a loopback address. Only a socket bound to 127.0.0.1 is reachable from inside
the pod alone (the preStop hook, `kubectl exec`, `kubectl port-forward`). The worker and the
router share this module, so it stays torch-free.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from tandem.web.errors import error_body
from tandem.worker_contract import DRAIN_PATH, HEALTH_PATH, METRICS_PATH, READY_PATH

OPEN_PATHS = frozenset({HEALTH_PATH, READY_PATH, METRICS_PATH})
# (method, path) of every state-changing admin route, the worker's and the router's;
# tests/server/test_admin_access.py checks both route tables against this set.
ADMIN_ROUTES = frozenset({
    ("POST", DRAIN_PATH), ("POST", "/flush_cache"), ("POST", "/abort_request"),  # worker (and router drain)
    ("POST", "/workers"), ("DELETE", "/workers"),  # router
})
# What the admin listener serves: the admin routes, the probes, and the router's worker list.
ADMIN_LISTENER_ROUTES = ADMIN_ROUTES | {("GET", p) for p in OPEN_PATHS} | {("GET", "/workers")}
# Set in the ASGI scope by the admin listener (never from anything a client sends).
ADMIN_LISTENER = "tandem.admin_listener"


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key else None


def admin_refusal(scope: dict, headers: dict[bytes, bytes], admin_key: bytes | None,
                  admin_port: int | None = None) -> str | None:
    """Why an admin route refuses this request, or None when it may go on: it came in on the
    admin listener, or with the admin key (`admin_key` is the whole header value, b"Bearer <key>")."""
    if scope.get(ADMIN_LISTENER) is True:
        return None
    if admin_key is not None and hmac.compare_digest(headers.get(b"authorization", b""), admin_key):
        return None
    where = f"{scope.get('method', '')} {scope.get('path', '')}".strip()
    listener = f"http://127.0.0.1:{admin_port}" if admin_port else "the admin listener (--admin-port)"
    inside = f"call it on {listener} from inside the pod (kubectl exec, or kubectl port-forward to that port)"
    if admin_key is None:
        return f"{where} is an admin endpoint: {inside}; no admin key is set (--admin-key or $TANDEM_ADMIN_KEY)"
    return f"{where} is an admin endpoint: {inside}, or send the admin key (not the API key) as " \
           "Authorization: Bearer <key>"


def forbidden_body(message: str) -> dict:
    body = error_body(403, message, code="admin_only")
    body["error"]["type"] = "permission_error"  # errors._TYPES has no 403 entry; server_error would mislead
    return body


class TooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: Any, api_key: str | None, max_bytes: int, admin_key: str | None = None,
                 admin_port: int | None = None) -> None:
        if api_key and admin_key == api_key:
            raise ValueError("the admin key must differ from the API key")
        self.app = app
        self.key, self.admin_key, self.admin_port = _bearer(api_key), _bearer(admin_key), admin_port
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if (scope.get("method"), scope["path"]) in ADMIN_ROUTES:
            refusal = admin_refusal(scope, headers, self.admin_key, self.admin_port)
            if refusal is not None:
                return await _send(send, 403, forbidden_body(refusal))
        elif self.key is not None and scope["path"] not in OPEN_PATHS and scope.get(ADMIN_LISTENER) is not True:
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
