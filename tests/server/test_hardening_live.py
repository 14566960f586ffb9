"""A real worker and router, hardened: bodies no server could use are 400s on both (never a 500,
which would open the router's breakers), the router reaches a worker that wants an API key with
--worker-api-key (the client's key never gets through), and both processes serve their admin
routes on the admin listener only (127.0.0.1:--admin-port) or to the admin key.

The worker's rejection is also checked in process (no model): JsonBodies runs before any route."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from bad_bodies import BAD_BODIES
from starlette.testclient import TestClient
from worker_process import Worker

from tandem.engine.engine_config import EngineConfig
from tandem.server.app import build_app
from tandem.server.config import ServerConfig

PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
WORKER_KEY, ROUTER_KEY, ADMIN_KEY = "worker-key", "client-key", "admin-key"


def _check_400s(post) -> None:
    for path in PATHS:
        for name, raw in BAD_BODIES.items():
            r = post(path, raw)
            assert r.status_code == 400, (path, name, r.status_code, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error", (path, name)


def test_the_worker_app_refuses_undecodable_bodies_before_any_route() -> None:
    config = ServerConfig(role="colocated", model_path="/nowhere", served_model_name="tiny", engine=EngineConfig())
    app = build_app(config)
    app.state.runtime = SimpleNamespace(config=config)  # nothing behind it: a body that got through would fail
    client = TestClient(app, raise_server_exceptions=False)
    _check_400s(lambda path, raw: client.post(path, content=raw, headers={"content-type": "application/json"}))


@pytest.fixture(scope="module")
def stack(model_path):
    model = model_path("tiny")
    worker = Worker.colocated(model, "--admin-key", ADMIN_KEY, api_key=WORKER_KEY)
    router = None
    try:
        worker.wait_ready()
        router = Worker.router(model, "--worker-api-key", WORKER_KEY, "--admin-key", ADMIN_KEY + "-r",
                               workers=[worker], api_key=ROUTER_KEY).wait_ready()
        yield router, worker
    finally:
        for w in (router, worker):
            if w is not None:
                w.stop()


def test_undecodable_bodies_are_400s_on_worker_and_router(stack) -> None:
    router, worker = stack
    for server in (worker, router):
        _check_400s(lambda path, raw, s=server: httpx.post(
            s.url + path, content=raw, timeout=60, headers={**s.headers(), "content-type": "application/json"}))
    assert not any(w["breaker"] != "closed" for w in router.admin("GET", "/workers").json()["workers"])
    ok = router.post("/v1/completions", {"model": "tiny", "prompt": "\U0001f600 still fine", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert worker.pool()["whole"]


def test_the_router_reaches_a_keyed_worker_with_the_worker_key(stack) -> None:
    router, worker = stack
    assert router.headers()["Authorization"] == f"Bearer {ROUTER_KEY}"  # the client's key: never the worker's
    as_client = httpx.post(worker.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30,
                           headers={"Authorization": f"Bearer {ROUTER_KEY}"})
    assert as_client.status_code == 401
    r = router.post("/generate", {"text": "keyed", "sampling_params": {"max_new_tokens": 3}, "stream": True})
    assert r.status_code == 200 and "[DONE]" in r.text
    assert all(w["healthy"] for w in router.admin("GET", "/workers").json()["workers"])  # health checks carry it


def test_admin_routes_on_the_admin_listener_or_with_the_admin_key(stack) -> None:
    router, worker = stack
    assert worker.admin("POST", "/flush_cache").status_code == 200
    for key in (None, WORKER_KEY):  # the API key is not the admin key; loopback on the main port is not enough
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.post(worker.url + "/flush_cache", headers=auth, timeout=30).status_code == 403
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(worker.url + "/flush_cache", headers=admin, timeout=30).status_code == 200
    assert router.admin("GET", "/health").status_code == 200
    assert router.admin("POST", "/v1/completions", {}).status_code == 404  # only admin routes and probes there
    refused = httpx.delete(router.url + "/workers", params={"url": worker.url}, headers=router.headers(), timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
