"""The router's Endpoint Picker over real gRPC with Envoy's protos: the answers GIE's protocol
asks for in each body mode, PD pairing, the subset hint, and hostile streams (each fails its
own request; the listener and the workers' load stay whole)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import ext_proc as xp
import grpc
import httpx
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_fakes import FakeWorker, fakes, router, run

from tandem.router.config import RouterConfig

Mode = processing_mode_pb2.ProcessingMode
GEN = {"text": "a long prompt " * 20, "sampling_params": {"max_new_tokens": 2}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.asynccontextmanager
async def epp(workers: int = 2, **kw: Any) -> AsyncIterator[tuple[str, list[str], Any]]:
    """Fake colocated workers and a router with its EPP: (EPP target, worker endpoints, app state)."""
    port = xp.free_port()
    ws = [FakeWorker() for _ in range(workers)]
    async with fakes(*ws) as urls:
        cfg = RouterConfig(model_name="tiny", workers=tuple(urls), policy="least_requests", health_interval=100,
                           epp_port=port, **kw)
        async with router(cfg) as (url, _):
            yield f"127.0.0.1:{port}", [u.removeprefix("http://") for u in urls], url


async def _load(url: str) -> int:
    """Requests the router holds on its workers (its admin API, served in-process here)."""
    async with httpx.AsyncClient() as c:
        return sum(w["requests"] for w in (await c.get(url + "/workers")).json()["workers"])


def test_full_duplex_holds_the_headers_answer_until_the_body_ends_then_routes_and_streams_it_back() -> None:
    async def test() -> None:
        async with epp() as (target, endpoints, url), xp.Stream(target) as s:
            data = json.dumps(GEN).encode()
            await s.send(xp.headers("POST", "/generate", eos=False), xp.body(data[:10], eos=False))
            assert await s.nothing_within(0.3)
            await s.send(xp.body(data[10:], eos=True))
            first, *rest = await s.read(2)
            sets, removes = xp.mutation(first.request_headers.response)
            dest = sets["x-gateway-destination-endpoint"]
            assert dest in endpoints and first.request_headers.response.clear_route_cache
            assert xp.metadata(first) == {"envoy.lb": {"x-gateway-destination-endpoint": dest}}
            assert "x-prefiller-host-port" in removes  # never passed on as a client wrote it
            assert xp.streamed(rest) == (data, True)  # the client's bytes, unchanged
            assert await _load(url) == 1  # held while the answer flows
            await s.send(xp.response_headers(200), xp.response_body(b"data: x\n\n", eos=True))
            answers = await s.read(2)
            assert answers[0].HasField("response_headers")
            assert answers[1].response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
            assert await s.close() == grpc.StatusCode.OK
            assert await _load(url) == 0

    run(test)


def test_buffered_mode_answers_headers_at_once_and_routes_with_the_body() -> None:
    async def test() -> None:
        async with epp() as (target, endpoints, url), xp.Stream(target) as s:
            await s.send(xp.headers("POST", "/v1/chat/completions", eos=False, mode=Mode.BUFFERED))
            (h,) = await s.read()
            assert h.HasField("request_headers") and not h.request_headers.response.header_mutation.set_headers
            await s.send(xp.body(json.dumps(CHAT).encode(), eos=True))
            (b,) = await s.read()
            sets, _ = xp.mutation(b.request_body.response)
            assert sets["x-gateway-destination-endpoint"] in endpoints
            dest = sets["x-gateway-destination-endpoint"]
            assert xp.metadata(b)["envoy.lb"]["x-gateway-destination-endpoint"] == dest
            assert not b.request_body.response.body_mutation.body  # nothing stripped: the body goes on as it came

    run(test)


def test_headers_only_and_streamed_mode_route_on_the_headers() -> None:
    async def test() -> None:
        async with epp() as (target, endpoints, _):
            async with xp.Stream(target) as s:
                await s.send(xp.headers("GET", "/v1/models", eos=True))
                (h,) = await s.read()
                assert xp.mutation(h.request_headers.response)[0]["x-gateway-destination-endpoint"] in endpoints
            async with xp.Stream(target) as s:
                await s.send(xp.headers("POST", "/generate", eos=False, mode=Mode.STREAMED))
                (h,) = await s.read()
                assert xp.mutation(h.request_headers.response)[0]["x-gateway-destination-endpoint"] in endpoints
                await s.send(xp.body(json.dumps(GEN).encode(), eos=True))
                (b,) = await s.read()
                assert b.HasField("request_body")

    run(test)


def test_router_only_fields_are_stripped_and_the_length_follows() -> None:
    async def test() -> None:
        async with epp() as (target, _, _), xp.Stream(target) as s:
            sent = {**GEN, "bootstrap_host": "evil", "bootstrap_port": 1, "bootstrap_room": 5, "rid": "x"}
            await s.send(xp.headers("POST", "/generate", eos=False, extra={"x-prefiller-host-port": "evil:1"}),
                         xp.body(json.dumps(sent).encode()))
            first, *rest = await s.read(2)
            sets, removes = xp.mutation(first.request_headers.response)
            forwarded, _ = xp.streamed(rest)
            assert json.loads(forwarded) == GEN
            assert sets["content-length"] == str(len(forwarded)) and "x-prefiller-host-port" in removes

    run(test)


def test_the_subset_hint_narrows_the_pick_and_an_empty_one_is_a_503() -> None:
    async def test() -> None:
        async with epp(workers=3) as (target, endpoints, _):
            for _ in range(4):
                async with xp.Stream(target) as s:
                    await s.send(xp.headers("GET", "/v1/models", eos=True, subset=[endpoints[2]]))
                    (h,) = await s.read()
                    assert xp.mutation(h.request_headers.response)[0]["x-gateway-destination-endpoint"] == endpoints[2]
            async with xp.Stream(target) as s:
                await s.send(xp.headers("GET", "/v1/models", eos=True, subset=["10.9.9.9:1"]))
                (h,) = await s.read()
                status, err = xp.immediate(h)
                assert status == 503 and "subset" in err["error"]["message"]

    run(test)


def test_fallbacks_follow_the_primary_in_header_and_metadata_alike() -> None:
    async def test() -> None:
        async with epp(workers=3, epp_fallbacks=2) as (target, endpoints, _), xp.Stream(target) as s:
            await s.send(xp.headers("GET", "/v1/models", eos=True))
            (h,) = await s.read()
            value = xp.mutation(h.request_headers.response)[0]["x-gateway-destination-endpoint"]
            assert sorted(value.split(",")) == sorted(endpoints)
            assert xp.metadata(h)["envoy.lb"]["x-gateway-destination-endpoint"] == value

    run(test)


@pytest.mark.parametrize("data, status", [(b"{not json", 400), (b'{"text": 1}', 400), (b"[]", 400),
                                          (b"x" * 70_000, 413)])
def test_bad_bodies_are_immediate_openai_errors(data: bytes, status: int) -> None:
    async def test() -> None:
        async with epp(max_request_bytes=65_536) as (target, _, url), xp.Stream(target) as s:
            await s.send(xp.headers("POST", "/generate", eos=False), xp.body(data))
            (h,) = await s.read()
            code, err = xp.immediate(h)
            assert code == status and err["error"]["message"]
            assert await _load(url) == 0

    run(test)


def test_the_api_key_is_checked_and_the_workers_key_sent_on() -> None:
    async def test() -> None:
        async with epp(api_key="client-key", worker_api_key="worker-key") as (target, _, _):
            async with xp.Stream(target) as s:
                await s.send(xp.headers("GET", "/v1/models", eos=True))
                assert xp.immediate((await s.read())[0])[0] == 401
            async with xp.Stream(target) as s:
                await s.send(xp.headers("GET", "/v1/models", eos=True, extra={"authorization": "Bearer client-key"}))
                sets, _ = xp.mutation((await s.read())[0].request_headers.response)
                assert sets["authorization"] == "Bearer worker-key"

    run(test)


def test_protocol_errors_end_one_stream_and_the_listener_goes_on() -> None:
    async def test() -> None:
        async with epp(max_request_bytes=65_536) as (target, endpoints, url):
            async with xp.Stream(target) as s:  # a body before any headers
                await s.send(xp.body(b"{}"))
                assert await s.close() == grpc.StatusCode.INVALID_ARGUMENT
            async with xp.Stream(target) as s:  # headers twice
                await s.send(xp.headers("GET", "/v1/models", eos=True), xp.headers("GET", "/", eos=True))
                await s.read()
                assert await s.close() == grpc.StatusCode.INVALID_ARGUMENT
            async with xp.Stream(target) as s:  # one message past the size cap
                await s.send(xp.headers("POST", "/generate", eos=False), xp.body(b"x" * 400_000))
                assert await s.close() == grpc.StatusCode.RESOURCE_EXHAUSTED
            async with xp.Stream(target) as s:  # a response before the request was routed
                await s.send(xp.response_headers(200))
                assert await s.close() == grpc.StatusCode.INVALID_ARGUMENT
            async with xp.Stream(target) as s:  # routed, then the gateway goes away mid-answer
                await s.send(xp.headers("GET", "/v1/models", eos=True))
                await s.read()
            async with xp.Stream(target) as s:  # still serving
                await s.send(xp.headers("GET", "/v1/models", eos=True))
                assert xp.mutation((await s.read())[0].request_headers.response)[0]["x-gateway-destination-endpoint"]
            from waits import async_wait_until

            async def _drained(url: str) -> bool:
                return await _load(url) == 0

            await async_wait_until(lambda: _drained(url), 5, "the load released")

    run(test)


def test_pd_pairs_a_prefill_worker_for_long_prompts_only() -> None:
    pre, dec = FakeWorker(), FakeWorker()

    async def test() -> None:
        port = xp.free_port()
        async with fakes(pre, dec) as (pre_url, dec_url), \
                router(RouterConfig(model_name="tiny", prefill=((pre_url, 9999),), decode=(dec_url,),
                                    health_interval=100, epp_port=port)):
            for text, paired in (("a long prompt " * 20, True), ("hi", False)):
                async with xp.Stream(f"127.0.0.1:{port}") as s:
                    await s.send(xp.headers("POST", "/generate", eos=False),
                                 xp.body(json.dumps({**GEN, "text": text}).encode()))
                    first, *_ = await s.read(2)
                    sets, removes = xp.mutation(first.request_headers.response)
                    assert sets["x-gateway-destination-endpoint"] == dec_url.removeprefix("http://")
                    if paired:
                        assert sets["x-prefiller-host-port"] == pre_url.removeprefix("http://")
                    else:
                        assert "x-prefiller-host-port" in removes and "x-prefiller-host-port" not in sets
            assert not pre.posts and not dec.posts  # the EPP only decides: the gateway carries the bytes

    run(test)


def test_health_names_gie_asks_for_are_serving() -> None:
    async def test() -> None:
        async with epp() as (target, _, _), grpc.aio.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, name

    run(test)
