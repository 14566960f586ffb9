"""A hypothesis campaign over the Endpoint Picker's stream: any sequence of ext-proc messages a
peer can send (headers of any method, path, count and mode; bodies of any bytes, split anywhere;
trailers; responses at any point; subset hints of any shape) gets answers or a clean end of
its own stream, within a bound, and never a hung stream, a dead listener or load left held."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import ext_proc as xp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import FakeWorker, fakes, router

from tandem.router.config import RouterConfig

GEN = json.dumps({"text": "a prompt " * 8, "sampling_params": {"max_new_tokens": 2}}).encode()
PATHS = ["/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/", "/generate?x=1", "\x00", ""]


@pytest.fixture(scope="module")
def epp_target() -> Iterator[tuple[str, dict]]:
    """Two fake workers and a router with its EPP, served from a thread's event loop for the
    whole campaign; `state` gives the router's app state (its workers' load)."""
    port, ready, stop = xp.free_port(), threading.Event(), threading.Event()
    box: dict = {}

    async def serve() -> None:
        async with fakes(FakeWorker(), FakeWorker()) as urls:
            cfg = RouterConfig(model_name="tiny", workers=tuple(urls), health_interval=100, epp_port=port,
                               max_request_bytes=4096)
            async with router(cfg) as (url, _):
                box["url"] = url
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)  # sleep-ok: the serving thread polls its stop flag

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    if not ready.wait(30):
        pytest.fail("the router with its EPP did not start")
    yield f"127.0.0.1:{port}", box
    stop.set()
    thread.join(15)


mode = st.sampled_from([None, 0, 1, 2, 3, 4, 5, 99])
headers = st.builds(
    lambda method, path, eos, m, extra, subset: xp.headers(method, path, eos, extra, mode=m, subset=subset),
    st.sampled_from(["POST", "GET", "PUT", "", "post"]), st.sampled_from(PATHS), st.booleans(), mode,
    st.dictionaries(st.sampled_from(["authorization", "x-prefiller-host-port", "content-length", "x-a"]),
                    st.text(st.characters(codec="utf-8"), max_size=20), max_size=3),
    st.none() | st.lists(st.sampled_from(["127.0.0.1:1", "", "x"]), max_size=3))
body = st.builds(xp.body, st.sampled_from([GEN, b"", b"{", b"[]", b"\xff\xfe", b"x" * 5000]) | st.binary(max_size=64),
                 st.booleans())
other = st.sampled_from([xp.trailers(), xp.response_headers(200), xp.response_headers(503, eos=True),
                         xp.response_body(b"data", eos=False), xp.response_body(b"", eos=True), pb.ProcessingRequest()])
streams = st.lists(st.one_of(headers, body, other), min_size=1, max_size=6)


def _exchange(target: str, messages: list[pb.ProcessingRequest]) -> None:
    """Send the whole sequence, read until the stream ends; the EPP must end it within the deadline,
    and never answer 500 (its answer to a bug in itself)."""
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10)
        try:
            for answer in call:
                if answer.HasField("immediate_response"):
                    assert answer.immediate_response.status.code != 500, answer.immediate_response.body
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.CANCELLED), exc


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(streams)
def test_any_message_sequence_ends_its_own_stream_cleanly(epp_target, messages) -> None:
    target, _ = epp_target
    _exchange(target, messages)


def test_after_the_campaign_the_listener_serves_and_no_load_is_held(epp_target) -> None:
    import httpx
    from waits import wait_until

    target, box = epp_target
    _exchange(target, [xp.headers("GET", "/v1/models", eos=True)])

    def idle() -> bool:
        workers = httpx.get(box["url"] + "/workers", timeout=5).json()["workers"]
        return sum(w["requests"] for w in workers) == 0

    wait_until(idle, 10, "the workers' load released")
