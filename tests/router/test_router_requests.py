"""What the router sends on, and when it sends again: retries only for failures another worker
may not have (router/proxy.py), fields only the router sets stripped from every body
(routes.ROUTER_FIELDS), and bodies no worker could use answered 400 before any worker sees
them (tandem/web/json_body.py). The real router app in front of recording fake workers."""

from __future__ import annotations

import json

import httpx
import pytest
from bad_bodies import BAD_BODIES
from router_fakes import FakeWorker, fakes, router, run

from tandem.router.config import RouterConfig

CLIENT_FIELDS = {"bootstrap_host": "evil.example", "bootstrap_port": 4242, "bootstrap_room": 7, "rid": "not-yours"}
BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
}


def colocated(urls: list[str], **kw: object) -> RouterConfig:
    return RouterConfig(model_name="tiny", workers=tuple(urls), policy="round_robin", health_interval=100, **kw)


# ---- retries ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [500, 400, 408])
def test_a_status_the_request_caused_goes_back_as_is_after_one_try(status: int) -> None:
    """Three workers that all fail: a hostile request that crashes one must not reach the others."""
    workers = [FakeWorker(status=status, error=f"worker says {status}") for _ in range(3)]

    async def test() -> None:
        async with fakes(*workers) as urls, router(colocated(urls)) as (url, _), httpx.AsyncClient() as c:
            r = await c.post(url + "/v1/completions", json=BODIES["/v1/completions"])
            assert r.status_code == status
            assert r.json()["error"]["message"] == f"worker says {status}"  # the worker's own body
            assert sum(len(w.posts) for w in workers) == 1

    run(test)


@pytest.mark.parametrize("status", [503, 429])
def test_draining_and_busy_workers_are_retried_elsewhere(status: int) -> None:
    workers = [FakeWorker(status=status), FakeWorker(status=status), FakeWorker()]

    async def test() -> None:
        async with fakes(*workers) as urls, router(colocated(urls)) as (url, _), httpx.AsyncClient() as c:
            for _ in range(3):
                r = await c.post(url + "/generate", json=BODIES["/generate"])
                assert r.status_code == 200, r.text
            assert len(workers[2].posts) == 3

    run(test)


def test_all_workers_busy_is_the_workers_429() -> None:
    async def test() -> None:
        async with fakes(FakeWorker(status=429, error="slow down")) as urls, router(colocated(urls)) as (url, _), \
                httpx.AsyncClient() as c:
            r = await c.post(url + "/generate", json=BODIES["/generate"])
            assert r.status_code == 429 and r.json()["error"]["message"] == "slow down"

    run(test)


def test_a_refused_connection_is_retried_on_another_worker() -> None:
    good = FakeWorker()

    async def test() -> None:
        async with fakes(good) as urls, router(colocated(["http://127.0.0.1:1", *urls])) as (url, _), \
                httpx.AsyncClient() as c:
            for _ in range(4):  # round robin: some start on the dead one
                assert (await c.post(url + "/generate", json=BODIES["/generate"])).status_code == 200
            assert len(good.posts) == 4

    run(test)


# ---- fields only the router sets ----------------------------------------------------------------------
@pytest.mark.parametrize("path", list(BODIES))
def test_client_bootstrap_fields_and_rid_never_reach_a_worker(path: str) -> None:
    w = FakeWorker()

    async def test() -> None:
        async with fakes(w) as urls, router(colocated(urls)) as (url, _), httpx.AsyncClient() as c:
            for stream in (False, True):
                assert (await c.post(url + path, json={**BODIES[path], **CLIENT_FIELDS, "stream": stream})).is_success
            for call in w.posts:
                assert not set(CLIENT_FIELDS) & set(call.json()), call.body
                assert call.json()["stream"] in (False, True)  # the rest is kept
            clean = json.dumps({**BODIES[path], "stream": False}).encode()  # nothing to strip: sent as it came
            await c.post(url + path, content=clean, headers={"content-type": "application/json"})
            assert w.posts[-1].body == clean

    run(test)


@pytest.mark.parametrize("prompt", ["hi", "a long prompt " * 20])  # decode alone; prefill + decode
def test_pd_bodies_carry_only_the_routers_bootstrap_fields(prompt: str) -> None:
    pre, dec = FakeWorker(), FakeWorker()

    async def test() -> None:
        async with fakes(pre, dec) as (pre_url, dec_url), httpx.AsyncClient() as c, \
                router(RouterConfig(model_name="tiny", prefill=((pre_url, 9999),), decode=(dec_url,),
                                    health_interval=100)) as (url, _):
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 2}, **CLIENT_FIELDS}
            assert (await c.post(url + "/generate", json=body)).status_code == 200
            sent = dec.posts[0].json()
            assert "rid" not in sent
            if len(prompt) < 32:
                assert not pre.posts and not set(CLIENT_FIELDS) & set(sent)
                return
            assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("127.0.0.1", 9999)
            assert sent["bootstrap_room"] != CLIENT_FIELDS["bootstrap_room"]
            assert {k: v for k, v in pre.posts[0].json().items() if k != "stream"} == \
                   {k: v for k, v in sent.items() if k != "stream"}

    run(test)


# ---- JSON Schemas: budgeted here, checked once, by the worker ----------------------------------------
def _with_schema(schema: object) -> dict:
    return {**BODIES["/v1/chat/completions"],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}


def test_the_router_budgets_schemas_and_leaves_their_check_to_the_worker() -> None:
    """The metaschema check is the worker's (on a thread, remembered): the router repeated it on its
    own event loop. A schema past the budget is refused here; one the worker refuses comes back
    as its 400 after one try, as often as it is sent, without opening the worker's breaker."""
    w = FakeWorker(status=400, error="response_format.json_schema.schema is not a valid JSON Schema")

    async def test() -> None:
        async with fakes(w) as urls, router(colocated(urls)) as (url, _), httpx.AsyncClient() as c:
            r = await c.post(url + "/v1/chat/completions", json=_with_schema({"anyOf": [{}] * 2000}))
            assert r.status_code == 400 and "MAX_SCHEMA_ITEMS" in r.json()["error"]["message"]
            assert not w.posts
            for _ in range(8):  # past the breaker's threshold of faults
                r = await c.post(url + "/v1/chat/completions", json=_with_schema({"type": "objekt"}))
                assert r.status_code == 400 and r.json()["error"]["message"] == w.error
            assert len(w.posts) == 8

    run(test)


def test_a_request_past_its_share_of_the_routers_slots_is_a_400_no_worker_sees() -> None:
    w = FakeWorker()

    async def test() -> None:
        async with fakes(w) as urls, router(colocated(urls, max_inflight=8)) as (url, _), httpx.AsyncClient() as c:
            r = await c.post(url + "/v1/completions", json={**BODIES["/v1/completions"], "prompt": ["a", "b"], "n": 1})
            assert r.status_code == 200, r.text
            r = await c.post(url + "/v1/completions", json={**BODIES["/v1/completions"], "prompt": ["a", "b"], "n": 2})
            assert r.status_code == 400 and "at most 2 per request" in r.json()["error"]["message"]
            assert len(w.posts) == 1

    run(test)


# ---- bodies no worker could use ------------------------------------------------------------------------


def test_undecodable_bodies_are_400s_that_never_reach_a_worker() -> None:
    w = FakeWorker()

    async def test() -> None:
        async with fakes(w) as urls, router(colocated(urls)) as (url, _), httpx.AsyncClient() as c:
            for path in BODIES:
                for name, raw in BAD_BODIES.items():
                    r = await c.post(url + path, content=raw, headers={"content-type": "application/json"})
                    assert r.status_code == 400, (path, name, r.text)
                    err = r.json()["error"]
                    assert err["type"] == "invalid_request_error" and err["message"], (path, name)
            assert not w.posts
            ok = await c.post(url + "/v1/completions", json={"model": "tiny", "prompt": "\U0001f600 fine"})
            assert ok.status_code == 200  # a surrogate pair is a character, not an error

    run(test)
