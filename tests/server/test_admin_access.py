"""Admin routes answer only the admin listener or the admin key (tandem/web/security.py,
admin_listener.py); loopback on the main listener is not enough, nor is the API key.

In process, without a model: the real worker app with a fake runtime behind it, and the
router's route table on a bare app. The ASGI scope's `client` plays the TCP peer; the admin
listener is the app behind AdminListener, as the second uvicorn server serves it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.routing import Route
from starlette.testclient import TestClient

from tandem.engine.engine_config import EngineConfig
from tandem.server import admin_routes
from tandem.server.app import build_app
from tandem.server.config import ServerConfig
from tandem.web import errors
from tandem.web.admin_listener import AdminListener
from tandem.web.security import ADMIN_LISTENER, ADMIN_ROUTES, Guard, admin_refusal

LOCAL = ("127.0.0.1", 40000)
REMOTE = ("10.1.2.3", 40000)
KEY = "s3cret"
ADMIN_KEY = "adm1n"
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


def worker(api_key: str | None, peer: tuple[str, int] = REMOTE, admin_key: str | None = None,
           admin_listener: bool = False) -> TestClient:
    """The worker app on its main listener, or (admin_listener) as the admin listener serves it."""
    config = ServerConfig(role="colocated", model_path="/nowhere", served_model_name="m",
                          engine=EngineConfig(), api_key=api_key, admin_key=admin_key)
    app = build_app(config)
    # No lifespan (it would load a model): the runtime the routes read is set by hand.
    app.state.runtime = SimpleNamespace(config=config, front=FakeFront(), ready=True,
                                        metrics=SimpleNamespace(render=lambda pools: "up 1\n"))
    return TestClient(AdminListener(app) if admin_listener else app, client=LOCAL if admin_listener else peer)


def call(client: TestClient, method: str, path: str, body: Any, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("api_key", [None, KEY])
@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_the_admin_listener_reaches_admin_routes_without_a_key(api_key, method, path, body) -> None:
    r = call(worker(api_key, admin_listener=True), method, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("peer", [LOCAL, REMOTE])
@pytest.mark.parametrize("api_key", [None, KEY])
@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_the_main_listener_refuses_admin_routes_without_the_admin_key(peer, api_key, method, path, body) -> None:
    """Loopback included: behind a mesh sidecar every caller is a loopback peer."""
    r = call(worker(api_key, peer), method, path, body, key=api_key)  # the API key is not the admin key
    assert r.status_code == 403
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == "admin_only"
    assert "127.0.0.1:8001" in err["message"] and path in err["message"] and "--admin-key" in err["message"]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_the_admin_key_opens_admin_routes_on_the_main_listener(method, path, body) -> None:
    client = worker(KEY, admin_key=ADMIN_KEY)
    assert call(client, method, path, body, key=ADMIN_KEY).status_code == 200
    assert call(client, method, path, body, key=KEY).status_code == 403  # the API key never does


def test_wrong_admin_keys_are_refused() -> None:
    client = worker(None, admin_key=ADMIN_KEY)
    for wrong in ("wrong", ADMIN_KEY + "x", ""):
        assert call(client, "POST", "/drain", None, key=wrong).status_code == 403
    assert client.post("/drain", headers={"Authorization": ADMIN_KEY}).status_code == 403  # no "Bearer "
    assert client.post("/drain", headers={"X-Forwarded-For": "127.0.0.1"}).status_code == 403


def test_the_admin_key_must_differ_from_the_api_key() -> None:
    with pytest.raises(ValueError, match="differ"):
        ServerConfig(role="colocated", model_path="/m", served_model_name="m", engine=EngineConfig(),
                     api_key=KEY, admin_key=KEY)
    with pytest.raises(ValueError, match="differ"):
        Guard(FastAPI(), api_key=KEY, max_bytes=1, admin_key=KEY)


@pytest.mark.parametrize("api_key", [None, KEY])
def test_probes_and_metrics_stay_open_to_remote_peers(api_key) -> None:
    client, admin = worker(api_key, REMOTE), worker(api_key, admin_listener=True)
    for path in OPEN_CALLS:
        assert client.get(path).status_code == 200, path
        assert admin.get(path).status_code == 200, path  # the admin listener answers the probes too


def test_openai_and_info_routes_keep_the_api_key_rule() -> None:
    client = worker(KEY, LOCAL)  # loopback does not waive the key
    assert client.get("/v1/models").status_code == 401
    assert client.get("/get_model_info").status_code == 401
    assert call(client, "POST", "/v1/completions", {"model": "m", "prompt": "x"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 401


def test_the_admin_listener_serves_nothing_else() -> None:
    admin = worker(KEY, admin_listener=True)
    for method, path in (("GET", "/v1/models"), ("GET", "/get_model_info"), ("POST", "/v1/completions"),
                         ("POST", "/generate"), ("GET", "/debug/pool")):
        r = call(admin, method, path, {"model": "m", "prompt": "x"})
        assert r.status_code == 404 and "admin listener" in r.json()["error"]["message"], path


def test_refusal_explains_both_ways_in() -> None:
    scope = {"client": REMOTE, "method": "DELETE", "path": "/workers"}
    assert "Authorization: Bearer <key>" in admin_refusal(scope, {}, b"Bearer k", 9001)
    assert "http://127.0.0.1:9001" in admin_refusal(scope, {}, b"Bearer k", 9001)
    assert admin_refusal(scope, {b"authorization": b"Bearer k"}, b"Bearer k") is None
    assert admin_refusal({**scope, "client": LOCAL}, {}, None) is not None  # loopback alone is not enough
    assert admin_refusal({**scope, ADMIN_LISTENER: True}, {}, None) is None


# ---- the router's admin routes, and no state-changing route left out of ADMIN_ROUTES -------------
def router_app(peer: tuple[str, int], api_key: str | None = None, admin_key: str | None = None,
               admin_listener: bool = False) -> TestClient:
    from tandem.router import routes

    app = FastAPI()
    errors.install(app)
    app.include_router(routes.router)
    app.state.router = SimpleNamespace(draining=False, admission=SimpleNamespace(inflight=0),
                                       workers=SimpleNamespace(remove=lambda url: None, workers={}))
    guarded = Guard(app, api_key=api_key, max_bytes=1 << 20, admin_key=admin_key)
    return TestClient(AdminListener(guarded) if admin_listener else guarded, client=peer)


def test_router_admin_routes_follow_the_same_rule() -> None:
    admin, remote = router_app(LOCAL, KEY, admin_listener=True), router_app(REMOTE, KEY, ADMIN_KEY)
    assert admin.post("/drain").json() == {"in_flight": 0}
    assert admin.delete("/workers", params={"url": "http://x"}).status_code == 404  # past the guard
    assert admin.get("/workers").status_code == 200
    assert router_app(LOCAL).post("/drain").status_code == 403  # loopback on the main listener
    for key in (None, KEY):
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        assert remote.post("/drain", headers=auth).status_code == 403
        assert remote.post("/workers", json={"url": "http://x:1"}, headers=auth).status_code == 403
        assert remote.delete("/workers", params={"url": "http://x"}, headers=auth).status_code == 403
    ok = remote.delete("/workers", params={"url": "http://x"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
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
