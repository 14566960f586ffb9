"""sglang-router (the real one, from PyPI) fronting two colocated `tandem serve` workers:
it discovers them through SGLang's worker API and returns the offline Engine's greedy text."""

from __future__ import annotations

import httpx
import pytest
from worker_process import Worker, sglang_router

from tandem import Engine

pytest.importorskip("sglang_router")
PROMPTS = [f"route me {i}" for i in range(8)]
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _served_requests(w: Worker) -> float:
    for line in w.get("/metrics").text.splitlines():
        if line.startswith('tandem_requests_total{reason="length"}'):
            return float(line.split()[-1])
    return 0.0


def test_sglang_router_fronts_two_workers(model_path) -> None:
    model = model_path("tiny")
    with Engine(str(model), dtype="float32") as eng:
        expected = [r["text"] for r in eng.generate(PROMPTS, SP)]
    workers = [Worker.colocated(model) for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        before = [_served_requests(w) for w in workers]
        router, url = sglang_router("--worker-urls", *(w.url for w in workers), "--policy", "round_robin")
        got = [httpx.post(url + "/generate", json={"text": p, "sampling_params": SP}, timeout=60).json()["text"]
               for p in PROMPTS]
        assert got == expected
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        served = [_served_requests(w) - b for w, b in zip(workers, before)]
        assert all(s >= 4 for s in served), served  # round robin reached both
        for w in workers:
            assert w.pool()["whole"]
    finally:
        if router is not None:
            router.terminate()
            router.wait(20)
        for w in workers:
            w.stop()


def test_sglang_router_pd_mode_fronts_our_prefill_and_decode(model_path) -> None:
    """`launch_router --pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`: the router
    adds bootstrap_host/port/room and sends to both; our decode streams the Engine's text."""
    pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()
    model = model_path("tiny")
    prompts = [f"disaggregated request {i} " * 6 for i in range(4)]  # past the local-prefill threshold
    with Engine(str(model), dtype="float32") as eng:
        expected = [r["text"] for r in eng.generate(prompts, SP)]
    pre = Worker.prefill(model)
    dec = Worker.decode(model, peers=[pre])
    router = None
    try:
        pre.wait_ready()
        dec.wait_ready()
        router, url = sglang_router("--pd-disaggregation", "--prefill", pre.url, str(pre.bootstrap),
                                    "--decode", dec.url)
        got = [httpx.post(url + "/generate", json={"text": p, "sampling_params": SP}, timeout=60).json()["text"]
               for p in prompts]
        assert got == expected
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 4,
            "temperature": 0})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        stats = [w.get("/debug/pool").json()["ranks"][0]["pd"] for w in (pre, dec)]
        assert stats[1]["transferred"] >= len(prompts) + 1 and stats[0]["sends"] >= len(prompts) + 1
        for w in (pre, dec):
            assert w.pool()["whole"]
    finally:
        if router is not None:
            router.terminate()
            router.wait(20)
        for w in (pre, dec):
            w.stop()
