"""Admin routes answer only the pod itself (loopback) or the API key (tandem/server/security.py).

In process, without a model: the real worker app with a fake runtime behind it, and the
router's route table on a bare app. The ASGI scope's `client` plays the TCP peer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.routing import Route
from starlette.testclient import TestClient

from tandem.engine.engine_config import EngineConfig
from tandem.server import admin_routes, errors
from tandem.server.app import build_app
from tandem.server.config import ServerConfig
from tandem.server.security import ADMIN_ROUTES, Guard, admin_refusal, is_loopback_peer

LOCAL = ("127.0.0.1", 40000)
REMOTE = ("10.1.2.3", 40000)
KEY = "s3cret"
ADMIN_CALLS = [("POST", "/drain", None), ("POST", "/flush_cache", None), ("POST", "/abort_request", {"rid": "r1"})]
OPEN_CALLS = ["/health", "/health/ready", "/metrics"]


class FakeFront:
    """What the admin routes call on Front, with nothing behind it."""

    draining = False
    error = None

    async def drain(self, timeout: float) -> dict[str, Any]:
        return {"aborted": 0, "timeout": timeout}

    async def admin(self, kind: type) -> list[Any]:
        return [SimpleNamespace(ok=True, info={"rank": 0})]

    def abort(self, rid: str) -> bool:
        return rid == "r1"

    async def pool_state(self) -> list[dict[str, Any]]:
        return []


def worker(api_key: str | None, peer: tuple[str, int]) -> TestClient:
    config = ServerConfig(role="colocated", model_path="/nowhere", served_model_name="m",
                          engine=EngineConfig(), api_key=api_key)
    app = build_app(config)
    # No lifespan (it would load a model): the runtime the routes read is set by hand.
    app.state.runtime = SimpleNamespace(config=config, front=FakeFront(), ready=True,
                                        metrics=SimpleNamespace(render=lambda pools: "up 1\n"))
    return TestClient(app, client=peer)


def call(client: TestClient, method: str, path: str, body: Any, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("api_key", [None, KEY])
@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_loopback_reaches_admin_routes_without_the_key(api_key, method, path, body) -> None:
    r = call(worker(api_key, LOCAL), method, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("api_key", [None, KEY])
@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_remote_peer_is_refused_with_403(api_key, method, path, body) -> None:
    r = call(worker(api_key, REMOTE), method, path, body)
    assert r.status_code == 403
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == "admin_only"
    assert "127.0.0.1" in err["message"] and path in err["message"]
    assert ("--api-key" in err["message"]) == (api_key is None)  # says how to get in


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_remote_peer_with_the_key_is_let_in(method, path, body) -> None:
    assert call(worker(KEY, REMOTE), method, path, body, key=KEY).status_code == 200


@pytest.mark.parametrize("api_key", [None, KEY])
def test_remote_peer_with_a_wrong_key_is_refused(api_key) -> None:
    client = worker(api_key, REMOTE)
    for wrong in ("wrong", KEY + "x", ""):
        assert call(client, "POST", "/drain", None, key=wrong).status_code == 403
    assert client.post("/drain", headers={"Authorization": KEY}).status_code == 403  # no "Bearer "


def test_forwarded_headers_never_make_a_peer_local() -> None:
    remote, local = worker(KEY, REMOTE), worker(KEY, LOCAL)
    for header in ("X-Forwarded-For", "X-Real-IP"):
        assert remote.post("/drain", headers={header: "127.0.0.1"}).status_code == 403
        # A loopback peer relaying for someone else (a sidecar proxy) is not the pod itself.
        assert local.post("/drain", headers={header: "10.9.9.9"}).status_code == 403
    assert local.post("/drain", headers={"Forwarded": "for=127.0.0.1"}).status_code == 403
    assert local.post("/drain", headers={"X-Forwarded-For": "10.9.9.9",
                                         "Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("api_key", [None, KEY])
def test_probes_and_metrics_stay_open_to_remote_peers(api_key) -> None:
    client = worker(api_key, REMOTE)
    for path in OPEN_CALLS:
        assert client.get(path).status_code == 200, path


def test_openai_and_info_routes_keep_the_api_key_rule() -> None:
    client = worker(KEY, LOCAL)  # loopback does not waive the key outside the admin routes
    assert client.get("/v1/models").status_code == 401
    assert client.get("/get_model_info").status_code == 401
    assert call(client, "POST", "/v1/completions", {"model": "m", "prompt": "x"}).status_code == 401


@pytest.mark.parametrize(("host", "local"), [
    ("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True), ("::1%lo", True),
    ("127.0.0.6", False),  # Istio's inbound passthrough source: remote traffic
    ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("0.0.0.0", False), ("testclient", False), ("", False),
])
def test_loopback_peer(host, local) -> None:
    assert is_loopback_peer({"client": (host, 1)}, {}) is local
    assert is_loopback_peer({"client": None}, {}) is False and is_loopback_peer({}, {}) is False


def test_refusal_explains_both_ways_in() -> None:
    scope = {"client": REMOTE, "method": "DELETE", "path": "/workers"}
    assert "Authorization: Bearer <key>" in admin_refusal(scope, {}, b"Bearer k")
    assert admin_refusal(scope, {b"authorization": b"Bearer k"}, b"Bearer k") is None
    assert admin_refusal({**scope, "client": LOCAL}, {}, None) is None


# ---- the router's admin routes, and no state-changing route left out of ADMIN_ROUTES -------------
def router_app(peer: tuple[str, int], api_key: str | None = None) -> TestClient:
    from tandem.router import routes

    app = FastAPI()
    errors.install(app)
    app.include_router(routes.router)
    app.state.router = SimpleNamespace(draining=False, admission=SimpleNamespace(inflight=0),
                                       workers=SimpleNamespace(remove=lambda url: None))
    return TestClient(Guard(app, api_key=api_key, max_bytes=1 << 20), client=peer)


def test_router_admin_routes_follow_the_same_rule() -> None:
    local, remote = router_app(LOCAL), router_app(REMOTE, KEY)
    assert local.post("/drain").json() == {"in_flight": 0}
    assert local.delete("/workers", params={"url": "http://x"}).status_code == 404  # past the guard
    assert remote.post("/drain").status_code == 403
    assert remote.post("/workers", json={"url": "http://x"}).status_code == 403
    assert remote.delete("/workers", params={"url": "http://x"}).status_code == 403
    ok = remote.delete("/workers", params={"url": "http://x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 404
    assert router_app(REMOTE).get("/health").status_code == 200


def mutations(routes: list[Any]) -> set[tuple[str, str]]:
    return {(m, r.path) for r in routes if isinstance(r, Route) for m in (r.methods or ()) if m not in ("GET", "HEAD")}


def test_every_state_changing_admin_route_is_guarded() -> None:
    """A new POST/DELETE in the worker's admin routes or the router's routes must join ADMIN_ROUTES
    (or this test names it); no stale entry either."""
    from tandem.router import routes

    worker_side, router_side = mutations(admin_routes.router.routes), mutations(routes.router.routes)
    assert worker_side <= ADMIN_ROUTES and router_side <= ADMIN_ROUTES
    assert worker_side | router_side == ADMIN_ROUTES
