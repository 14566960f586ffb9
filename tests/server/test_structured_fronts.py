"""Structured outputs and tool calls through every front a deployment puts before the workers:
`tandem router` over colocated workers and over prefill + decode, and the real sglang-router
over the same two. The workers parse tool calls; each front passes the constraint through
untouched (in PD the prefill samples the first token under it), and the official openai client
gets valid JSON, parsed objects and tool calls that stream into the non-streamed ones.
Every test leaves the workers' pools whole."""

from __future__ import annotations

import pytest
from structured_checks import (
    check_n_choices_each_valid,
    check_parse,
    check_required_tools,
    check_streamed_calls_equal_whole,
)
from worker_process import Worker, running, sglang_router

openai = pytest.importorskip("openai")
FLAGS = ("--tool-call-parser", "hermes", "--max-total-tokens", "16384")


@pytest.fixture(scope="module")
def colocated(model_path):
    with running(*(Worker.colocated(model_path("tiny"), *FLAGS) for _ in range(2))) as workers:
        yield list(workers)


@pytest.fixture(scope="module")
def pd(model_path):
    """Every prompt is disaggregated: decode never prefills locally."""
    pre = Worker.prefill(model_path("tiny"), *FLAGS)
    dec = Worker.decode(model_path("tiny"), *FLAGS, "--pd-local-prefill-threshold", "0", peers=[pre])
    with running(pre, dec):
        yield pre, dec


def _tandem_router(request, model_path) -> tuple[str, object]:
    if request.param.endswith("colocated"):
        router = Worker.router(model_path("tiny"), workers=request.getfixturevalue("colocated"))
    else:
        pre, dec = request.getfixturevalue("pd")
        router = Worker.router(model_path("tiny"), "--local-prefill-threshold", "0", prefill=[pre], decode=[dec])
    return router.wait_ready().url, router.stop


def _sglang_router(request) -> tuple[str, object]:
    pytest.importorskip("sglang_router")
    if request.param.endswith("colocated"):
        proc, url = sglang_router("--worker-urls", *(w.url for w in request.getfixturevalue("colocated")))
    else:
        pre, dec = request.getfixturevalue("pd")
        proc, url = sglang_router("--pd-disaggregation", "--prefill", pre.url, str(pre.bootstrap),
                                  "--decode", dec.url)

    def stop() -> None:
        proc.terminate()
        proc.wait(20)

    return url, stop


@pytest.fixture(scope="module", params=["tandem-colocated", "tandem-pd", "sglang-colocated", "sglang-pd"])
def front(request, model_path):
    url, stop = (_tandem_router(request, model_path) if request.param.startswith("tandem")
                 else _sglang_router(request))
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), request.param
    finally:
        stop()


@pytest.fixture(autouse=True)
def pools_whole(front, request):
    workers = request.getfixturevalue("colocated" if front[1].endswith("colocated") else "pd")
    yield
    for w in workers:
        assert w.pool()["whole"], w.output()


def test_parse_and_n_choices(front) -> None:
    client, _ = front
    check_parse(client)
    check_n_choices_each_valid(client)


def test_required_tool_calls(front) -> None:
    check_required_tools(front[0])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_whole(front, choice) -> None:
    check_streamed_calls_equal_whole(front[0], choice)
