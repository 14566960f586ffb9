"""schemathesis against the worker's own OpenAPI schema for /generate and /v1/*, and against the
router's in front of it: generated bodies, valid (positive mode) and invalid on purpose
(negative mode: wrong types, out-of-range numbers, missing fields), never get a 5xx, never crash
a server, never leak a page.

The worker runs with --max-context-len 128 so a generated max_tokens cannot make a case slow."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from waits import wait_until  # noqa: E402
from worker_process import Worker  # noqa: E402

from tandem.engine.engine_config import EngineConfig  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.config import ServerConfig  # noqa: E402

_APP = build_app(ServerConfig(role="colocated", model_path="unused", served_model_name="tiny",
                              engine=EngineConfig()))
BOTH_MODES = SchemathesisConfig.from_dict({"generation": {"mode": "all"}})
schema = schemathesis.openapi.from_dict(_APP.openapi(), config=BOTH_MODES).include(path_regex=r"^/(generate|v1/)")


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


@pytest.fixture(scope="module")
def fuzz_router(fuzz_worker, model_path):
    with Worker.router(model_path("tiny"), workers=[fuzz_worker]) as r:
        yield r
        assert r.get("/health").status_code == 200, r.output()


# The router's proxied routes live on its fast path, outside FastAPI's schema; it validates them
# with the workers' own models, so the worker's schema is the router's too.
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors_through_the_router(case, fuzz_router) -> None:
    response = case.call(base_url=fuzz_router.url, timeout=120)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])


def test_stateful_interleavings_never_fail_the_worker(fuzz_worker) -> None:
    """Hypothesis' stateful testing: requests that share client rids, streams cut off after some
    chunks, aborts by rid and cache flushes, interleaved in generated orders. No step gets a
    5xx, a rid names one request at a time, and the pool is whole at the end of every run."""
    import httpx
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

    rids = st.sampled_from(["a", "b", "c"])
    statuses: list[int] = []

    class Interleavings(RuleBasedStateMachine):
        @rule(rid=rids, tokens=st.integers(1, 6), stream=st.booleans())
        def generate(self, rid: str, tokens: int, stream: bool) -> None:
            body = {"text": "state " * tokens, "rid": rid, "stream": stream,
                    "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
            r = httpx.post(fuzz_worker.url + "/generate", json=body, timeout=120)
            statuses.append(r.status_code)
            if r.status_code == 200 and not stream:
                assert len(r.json()["output_ids"]) == tokens and r.json()["meta_info"]["id"] == rid

        @rule(rid=rids, keep=st.integers(0, 3))
        def stream_then_leave(self, rid: str, keep: int) -> None:
            body = {"text": "leave", "rid": rid, "stream": True,
                    "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
            with httpx.stream("POST", fuzz_worker.url + "/generate", json=body, timeout=120) as r:
                statuses.append(r.status_code)
                for i, _ in enumerate(r.iter_lines()):
                    if i >= keep:
                        break

        @rule(rid=rids)
        def abort(self, rid: str) -> None:
            statuses.append(fuzz_worker.admin("POST", "/abort_request", {"rid": rid}).status_code)

        @rule()
        def flush(self) -> None:
            statuses.append(fuzz_worker.admin("POST", "/flush_cache").status_code)

        @invariant()
        def no_server_error(self) -> None:
            assert all(s < 500 for s in statuses), statuses

        def teardown(self) -> None:
            # idle once the cut-off streams' aborts land
            wait_until(lambda: fuzz_worker.pool()["whole"], 30, "the fuzzed worker idle and whole")

    run_state_machine_as_test(Interleavings, settings=settings(
        max_examples=6, stateful_step_count=10, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
