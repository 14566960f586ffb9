"""Faults and lifecycle: a client that leaves mid-stream, a request larger than the pool,
a full admission queue, the API key, body limits, abort, flush, metrics, and drain (the
endpoint and SIGTERM) with requests in flight. Each ends with the KV pool whole, checked
from outside the process."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
from waits import wait_until
from worker_process import Worker

LONG = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}


def test_client_closing_a_stream_aborts_its_request(worker) -> None:
    with httpx.stream("POST", worker.url + "/generate", json={"text": "x", "sampling_params": LONG,
                                                              "stream": True}, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    state = worker.pool()
    assert state["whole"] and state["ranks"][0]["num_running"] == 0, state


def test_non_streaming_client_disconnect_aborts(worker) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(worker.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2000,
                                                         "ignore_eos": True}, timeout=0.5)
    assert worker.pool()["whole"]


def test_request_larger_than_the_pool_is_400(worker) -> None:
    r = worker.post("/v1/completions", {"model": "tiny", "prompt": [1] * 3000, "max_tokens": 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert worker.pool()["whole"]


def test_abort_request_and_flush_and_metrics(worker) -> None:
    done: list[httpx.Response] = []
    t = threading.Thread(target=lambda: done.append(worker.post(
        "/generate", {"text": "x", "rid": "victim", "sampling_params": LONG})))
    t.start()
    wait_until(lambda: worker.admin("POST", "/abort_request", {"rid": "victim"}).json()["aborted"], 10,
               "the victim in flight, then aborted")
    t.join(60)
    assert done and done[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert worker.pool()["whole"]
    flushed = worker.admin("POST", "/flush_cache").json()
    assert flushed["ok"] and flushed["ranks"][0]["free_tokens"] == flushed["ranks"][0]["capacity_tokens"]
    text = worker.get("/metrics").text
    for name in ("tandem_time_to_first_token_seconds_bucket", "tandem_num_running_reqs", "tandem_kv_cache_usage",
                 "tandem_requests_total", "tandem_kv_pool_whole 1.0"):
        assert name in text, name


def test_info_and_probes(worker) -> None:
    info = worker.get("/get_server_info").json()
    assert info["model_path"].endswith(info["model_path"].split("/")[-1]) and info["role"] == "colocated"
    assert worker.get("/get_model_info").json()["is_generation"]
    assert worker.get("/health").status_code == worker.get("/health/ready").status_code == 200
    assert worker.get("/health_generate").status_code == 200


def test_api_key_admission_limit_and_body_limit(model_path) -> None:
    with Worker.colocated(model_path("tiny"), "--max-queued-requests", "1", "--max-running-requests", "1",
                          "--max-request-bytes", "2000", api_key="s3cret") as w:
        open_ = httpx.get(w.url + "/health/ready", timeout=10)
        assert open_.status_code == 200
        for path in ("/v1/models", "/get_model_info"):
            r = httpx.get(w.url + path, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # Admin routes: the admin listener answers without a key (the preStop hook calls /drain
        # there); the main port refuses loopback and the API key alike (test_admin_access.py).
        assert w.admin("POST", "/flush_cache").status_code == 200
        assert httpx.post(w.url + "/flush_cache", headers=w.headers(), timeout=10).status_code == 403
        big = w.post("/v1/completions", {"model": "tiny", "prompt": "x" * 5000})
        assert big.status_code == 413
        streams = [httpx.stream("POST", w.url + "/generate", headers=w.headers(), timeout=60,
                                json={"text": "x", "sampling_params": LONG, "stream": True}) for _ in range(2)]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            r = w.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        assert w.pool()["whole"]


@pytest.mark.parametrize("how", ["endpoint", "sigterm"])
def test_drain_with_requests_in_flight(model_path, how) -> None:
    w = Worker.colocated(model_path("tiny"), "--drain-timeout", "1").wait_ready()
    try:
        results: list[httpx.Response] = []
        short = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        threads = [threading.Thread(target=lambda sp=sp: results.append(w.post("/generate", {"text": "x",
                   "sampling_params": sp}))) for sp in (short, LONG | {"max_new_tokens": 3000}, short)]
        for t in threads:
            t.start()
        # All three admitted: each has either answered already or is running.
        wait_until(lambda: len(results) + w.running() >= 3, 30, "the three requests admitted")
        if how == "endpoint":
            report = w.admin("POST", "/drain", {"timeout": 1.0}).json()
            assert report["pool_whole"] and report["aborted"] >= 1, report
        else:
            w.terminate()
            wait_until(lambda: w.get("/health/ready").status_code == 503, 10, "readiness off while draining")
            assert w.post("/generate", {"text": "x"}).status_code == 503
        for t in threads:
            t.join(60)
        kinds = sorted(r.json()["meta_info"]["finish_reason"]["type"] for r in results)
        assert kinds == ["abort", "length", "length"], [r.text for r in results]
        assert w.proc.wait(60) == 0
        assert "KV pool whole" in w.output(), w.output()
    finally:
        w.stop()


def test_dead_scheduler_and_a_sigterm_at_once_still_exit(model_path) -> None:
    """The scheduler process killed and a SIGTERM right behind it: the worker exits, as one whose
    scheduler died (non-zero: it must be replaced), and nothing hangs (its shutdown once blocked
    on a send to the dead rank). Without the SIGTERM: tests/server/test_hostile_requests.py."""
    from pathlib import Path

    w = Worker.colocated(model_path("tiny")).wait_ready()
    try:
        children = [int(c) for t in Path(f"/proc/{w.proc.pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        scheduler = next(c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text())
        import os

        os.kill(scheduler, signal.SIGKILL)
        w.terminate()
        assert w.proc.wait(30) == 70, w.output()
    finally:
        w.stop()
