"""`tandem router` in front of real workers: the official openai client's suite in colocated
and PD modes, greedy output equal to the offline Engine, and the fault paths (a worker
killed mid-stream, a restarted worker readmitted, a client disconnect aborting on the
workers). Every test leaves the workers' pools whole."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from waits import wait_until
from worker_process import Worker, free_port

from tandem import Engine

openai = pytest.importorskip("openai")
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def colocated(model_path):
    model = model_path("tiny")
    workers = [Worker.colocated(model) for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        router = Worker.router(model, "--policy", "round_robin", workers=workers).wait_ready()
        yield router, workers
    finally:
        for w in [router, *workers]:
            if w is not None:
                w.stop()


@pytest.fixture(scope="module")
def pd(model_path):
    model = model_path("tiny")
    pre = Worker.prefill(model)
    dec = Worker.decode(model, peers=[pre])
    router = None
    try:
        for w in (pre, dec):
            w.wait_ready()
        router = Worker.router(model, "--local-prefill-threshold", "0", prefill=[pre], decode=[dec]).wait_ready()
        yield router, [pre, dec]
    finally:
        for w in [router, pre, dec]:
            if w is not None:
                w.stop()


@pytest.fixture(params=["colocated", "pd"])
def stack(request):
    router, workers = request.getfixturevalue(request.param)
    yield router, workers
    for w in workers:
        assert w.pool()["whole"], w.output()


def _client(router: Worker):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_suite(stack) -> None:
    router, _ = stack
    c = _client(router)
    r = c.completions.create(model="tiny", prompt="hello router " * 8, max_tokens=6, temperature=0, n=2,
                             logprobs=2, stop=["zzz"])
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 12
    assert len(r.choices[0].logprobs.tokens) == 6
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there " * 8}],
                                     max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content is not None and len(chat.choices[0].logprobs.content) == 5
    chunks = list(c.completions.create(model="tiny", prompt="streaming through the router " * 4, max_tokens=6,
                                       temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    for bad in ({"model": "nope", "prompt": "x"}, {"model": "tiny", "prompt": "x", "temperature": -1},
                {"model": "tiny", "prompt": "x " * 5000, "max_tokens": 10}):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(**bad)
    r = httpx.post(router.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_greedy_text_equals_the_engine(stack, model_path) -> None:
    router, _ = stack
    prompts = [f"the engine and the router agree {i} " * 4 for i in range(6)]
    with Engine(str(model_path("tiny")), dtype="float32") as eng:
        expected = [r["token_ids"] for r in eng.generate(prompts, SP)]
    got = [router.post("/generate", {"text": p, "sampling_params": SP}).json()["output_ids"] for p in prompts]
    assert got == expected


def test_client_disconnect_aborts_on_the_workers(stack) -> None:
    router, workers = stack
    body = {"model": "tiny", "prompt": "never mind " * 10, "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                # A stream holds its admission slot until it ends (read before leaving the loop:
                # breaking out of iter_lines closes the response).
                metrics = router.get("/metrics").text
                assert "tandem_router_inflight_requests 1.0" in metrics
                break  # the first token arrived: now go away
    wait_until(lambda: not any(w.running() for w in workers), 15,
               "the workers to stop generating for a client that left")


def test_worker_killed_mid_stream_then_readmitted(model_path) -> None:
    model = model_path("tiny")
    workers = [Worker.colocated(model) for _ in range(2)]
    router = restarted = None
    try:
        for w in workers:
            w.wait_ready()
        router = Worker.router(model, "--policy", "least_requests", workers=workers).wait_ready()
        body = {"model": "tiny", "prompt": "a long answer " * 5, "max_tokens": 3000, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(x for x in lines if x.startswith("data: {"))
            busy = next(w for w in workers if w.get("/debug/pool").json()["ranks"][0]["num_running"])
            os.killpg(busy.proc.pid, signal.SIGKILL)
            rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and any('"error"' in x and "mid-stream" in x for x in rest), rest[-3:]
        other = next(w for w in workers if w is not busy)
        for _ in range(4):  # the next requests go to the live worker
            assert router.post("/generate", {"text": "next", "sampling_params": SP}).status_code == 200
        listed = lambda: {w["url"]: w for w in router.get("/workers").json()["workers"]}  # noqa: E731
        # health checks (every 0.5 s) mark the dead one down
        wait_until(lambda: not listed()[busy.url]["healthy"], 15, "the dead worker marked down")
        assert listed()[other.url]["healthy"]
        args = busy.proc.args[busy.proc.args.index("serve"):]
        restarted = Worker(args, port=busy.port).wait_ready()
        wait_until(lambda: listed()[busy.url]["healthy"], 15, "the restarted worker readmitted")
        for w in (other, restarted):
            assert w.pool()["whole"]
    finally:
        for w in (router, restarted, *workers):
            if w is not None:
                w.stop()


def test_a_router_started_before_its_worker_learns_the_model_name(model_path) -> None:
    """The README's by-hand stack starts the router with the workers still loading: /v1/models
    used to name no model for the router's whole life."""
    model = model_path("tiny")

    class Later:  # the worker's URL, before there is a worker
        url = f"http://127.0.0.1:{free_port()}"

    router = Worker.router(model, workers=[Later()])  # type: ignore[list-item]
    worker = None
    try:
        wait_until(lambda: _answers(router.url + "/v1/models"), 120, f"the router listening\n{router.output()}")
        assert httpx.get(router.url + "/v1/models").json()["data"] == []  # no model named yet
        worker = Worker(Worker.colocated_argv(model), port=int(Later.url.rsplit(":", 1)[1])).wait_ready()
        wait_until(lambda: [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == ["tiny"], 60,
                   f"the router naming the model\n{router.output()}")
        assert worker.pool()["whole"], worker.output()
    finally:
        for w in (router, worker):
            if w is not None:
                w.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
