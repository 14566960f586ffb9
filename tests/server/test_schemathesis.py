"""schemathesis against the worker's own OpenAPI schema for /generate and /v1/*: generated
bodies, valid and not, never get a 5xx, never crash the server, never leak a page.

The worker runs with --max-context-len 128 so a generated max_tokens cannot make a case slow."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from worker_process import Worker  # noqa: E402

from tandem.engine.engine_config import EngineConfig  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.config import ServerConfig  # noqa: E402

_APP = build_app(ServerConfig(role="colocated", model_path="unused", served_model_name="tiny",
                              engine=EngineConfig()))
schema = schemathesis.openapi.from_dict(_APP.openapi()).include(path_regex=r"^/(generate|v1/)")


@pytest.fixture(scope="module")
def fuzz_worker(model_path):
    with Worker.colocated(model_path("tiny"), "--max-context-len", "128") as w:
        yield w
        assert w.get("/health").status_code == 200, w.output()
        assert w.pool()["whole"], w.output()


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, fuzz_worker) -> None:
    response = case.call(base_url=fuzz_worker.url, timeout=120)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
