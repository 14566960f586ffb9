"""PD failure paths: nothing hangs, every error is clear, no KV page leaks. Each test ends
with the pools of every live worker whole, checked from outside the processes. Whole
includes the lifecycle's own check (engine/scheduler/lifecycle.py): every request a worker
received was retired exactly once, whichever way it ended.

Timeouts are short here (heartbeat 3 s, bootstrap 4 s) so dead peers are found quickly."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import time

import httpx
import pytest
from pd_client import pd_generate, pd_post, pd_stats
from waits import wait_until
from worker_process import Worker, free_port

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

FAST = ("--pd-heartbeat-interval", "0.5", "--pd-heartbeat-timeout", "3", "--pd-bootstrap-timeout", "4",
        "--pd-transfer-timeout", "8", "--max-total-tokens", "4096")
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
DEAD = free_port()  # a configured prefill peer nobody listens on: its handshake never answers
BAD_SCHEMA = '{"type": "object", "properties": {"a": {"type": "nope"}}}'  # valid JSON, no such type


@pytest.fixture(scope="module")
def pair(model_path):
    model = model_path("tiny")
    pre = Worker.prefill(model, *FAST)
    dec = Worker.decode(model, *FAST, peers=[pre, f"127.0.0.1:{DEAD}"])
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec
    finally:
        dec.stop()
        pre.stop()


def _whole(*workers: Worker) -> None:
    for w in workers:
        state = w.pool()
        assert state["whole"], (state, w.output())


def _in_thread(fn, *args):
    ex = cf.ThreadPoolExecutor(1)
    fut = ex.submit(fn, *args)
    ex.shutdown(wait=False)
    return fut


def _raw_pd(w: Worker) -> dict:
    return w.get("/debug/pool").json()["ranks"][0]["pd"]


def _wait(cond, timeout: float = 15.0) -> None:
    wait_until(cond, timeout, "the condition", interval=0.05)


def _wait_up(w: Worker) -> None:
    """Up (its scheduler answers) though never ready: no handshake holds."""

    def up() -> bool:
        try:
            return "no prefill peer" in w.get("/health/ready").text
        except httpx.HTTPError:
            assert w.proc.poll() is None, w.output()
            return False

    _wait(up, timeout=180)


def test_each_role_retires_every_request_once(pair) -> None:
    """A finish and a stop (decode's on the first token it reads from prefill's slot): each role
    counts each request once among its finished, by reason, and keeps none registered. A
    grammar that does not compile is refused by each front (400) and never reaches either."""
    pre, dec = pair
    before = [w.get("/debug/pool").json()["ranks"][0]["requests"] for w in (pre, dec)]
    # A prompt long enough that decode does not prefill it itself; its cache is flushed after the
    # reference run, so that the same prompt goes to prefill again.
    body = {"text": "long enough that decode does not prefill it itself " * 4, "sampling_params": SP}
    _, d = pd_post(pre, dec, "/generate", body)
    ref = d.json()["output_ids"]
    stop = ref[0]  # decode ends on the first token, read from prefill's slot (Host.join_decoding)
    answers = []
    for sp in ({**SP, "ignore_eos": False, "stop_token_ids": [stop]}, {**SP, "json_schema": BAD_SCHEMA}):
        assert dec.admin("POST", "/flush_cache").status_code == 200
        p, d = pd_post(pre, dec, "/generate", {**body, "sampling_params": sp})
        answers.append([r.json()["meta_info"]["finish_reason"]["type"] if r.status_code == 200 else r.status_code
                        for r in (p, d)])
    assert answers == [["stop", "stop"], [400, 400]]  # prefill samples the stop token too
    _whole(pre, dec)
    for w, was, ended in ((pre, before[0], {"length": 1, "stop": 1}), (dec, before[1], {"length": 1, "stop": 1})):
        now = w.get("/debug/pool").json()["ranks"][0]["requests"]
        assert now["received"] - was["received"] == 2 and (now["registered"], now["held"]) == (0, 0), now
        assert {k: n - was["finished"].get(k, 0) for k, n in now["finished"].items()
                if n != was["finished"].get(k, 0)} == ended, (was, now)


def test_handshake_mismatch_fails_fast_in_both_logs(pair, model_path) -> None:
    pre, _ = pair
    bad = Worker.decode(model_path("tiny"), *FAST, "--page-size", "16", peers=[pre])
    try:
        _wait_up(bad)
        t0 = time.monotonic()
        p, d = pd_post(pre, bad, "/generate", {"text": "mismatch", "sampling_params": SP})
        assert d.status_code == 503 and "page_size" in d.json()["error"]["message"], d.text
        assert p.status_code == 408  # prefill's side ends at its bootstrap timeout (no decode claimed it), not later
        assert time.monotonic() - t0 < 10
        assert _raw_pd(bad)["handshake_failures"] >= 1 and _raw_pd(pre)["handshake_failures"] >= 1
        assert "handshake refused" in bad.output() and "handshake refused" in pre.output()
        assert "16" not in d.json()["error"]["message"]  # prefill names the field, never its own values
        _whole(bad)
    finally:
        bad.stop()
    _whole(pre)


def test_abort_and_timeout_while_bootstrapping(pair) -> None:
    _, dec = pair
    body = {"text": "nobody home", "sampling_params": SP, "rid": "boot-abort",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": DEAD, "bootstrap_room": 11}
    fut = _in_thread(dec.post, "/generate", body)
    _wait(lambda: _raw_pd(dec)["rooms"] == 1)
    assert dec.admin("POST", "/abort_request", {"rid": "boot-abort"}).json()["aborted"]
    assert fut.result(10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    t0 = time.monotonic()
    r = dec.post("/generate", {**body, "rid": "boot-timeout", "bootstrap_room": 12})
    assert r.status_code == 503 and "no handshake" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 8
    _whole(dec)


def test_abort_and_timeout_while_prefill_waits_for_pages(pair) -> None:
    pre, _ = pair
    body = {"text": "no decode claims me", "sampling_params": SP, "rid": "wait-abort",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pre.bootstrap, "bootstrap_room": 21}
    fut = _in_thread(pre.post, "/generate", body)
    _wait(lambda: _raw_pd(pre)["rooms"] == 1)
    assert pre.admin("POST", "/abort_request", {"rid": "wait-abort"}).json()["aborted"]
    assert fut.result(10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    r = pre.post("/generate", {**body, "rid": "wait-timeout", "bootstrap_room": 22})
    assert r.status_code == 408 and "no decode claimed" in r.json()["error"]["message"], r.text
    _whole(pre)


def test_abort_while_transferring_frees_pages_on_both_sides(pair) -> None:
    pre, dec = pair
    room = random.randrange(2**63)
    body = {"text": "cancel me mid transfer " * 10, "sampling_params": SP, "rid": "xfer-abort",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pre.bootstrap, "bootstrap_room": room}
    fut = _in_thread(dec.post, "/generate", body)  # decode reserves pages; prefill has no request yet
    _wait(lambda: _raw_pd(dec)["rooms"] == 1 and _raw_pd(dec)["queued"] == 0)
    assert dec.admin("POST", "/abort_request", {"rid": "xfer-abort"}).json()["aborted"]
    assert fut.result(10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    _wait(lambda: _raw_pd(dec)["rooms"] == 0)  # prefill confirmed: nothing will be written
    late = pre.post("/generate", body).json()  # the request reaches prefill after the cancel
    assert "cancelled by decode" in late["meta_info"]["finish_reason"]["message"]
    _whole(pre, dec)


def test_abort_while_decoding(pair) -> None:
    pre, dec = pair
    body = {"text": "a long answer, please " * 10, "sampling_params": {**SP, "max_new_tokens": 3000},
            "rid": "dec-abort"}
    fut = _in_thread(pd_post, pre, dec, "/generate", body)
    _wait(lambda: dec.get("/debug/pool").json()["ranks"][0]["num_running"] == 1)
    assert dec.admin("POST", "/abort_request", {"rid": "dec-abort"}).json()["aborted"]
    p, d = fut.result(30)
    assert d.json()["meta_info"]["finish_reason"]["type"] == "abort" and p.status_code == 200
    _whole(pre, dec)


def test_conditional_disaggregation_prefills_short_prompts_on_decode(pair) -> None:
    pre, dec = pair
    before = _raw_pd(dec)["local_prefills"], _raw_pd(pre)["sends"]
    short = {"text": "short", "sampling_params": SP}
    got = pd_generate(pre, dec, short)
    assert got["output_ids"] == dec.post("/generate", short).json()["output_ids"]
    assert _raw_pd(dec)["local_prefills"] == before[0] + 1 and _raw_pd(pre)["sends"] == before[1]
    _whole(pre, dec)


def test_decode_pool_full_waits_then_completes(pair, model_path) -> None:
    pre, dec = pair
    prompts = [f"fill the pool {i} " * 50 for i in range(6)]
    expected = [pd_generate(pre, dec, {"text": p, "sampling_params": SP})["output_ids"] for p in prompts]
    flags = (*FAST, "--max-total-tokens", "700", "--disable-radix-cache")  # room for about two at a time
    with Worker.decode(model_path("tiny"), *flags, peers=[pre]) as small:
        with cf.ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda p: pd_generate(pre, small, {"text": p, "sampling_params": SP}), prompts))
        assert [g["output_ids"] for g in got] == expected
        assert pd_stats(small)[0]["failed"] == 0
        _whole(small)
    _whole(pre, dec)


def test_prefill_killed_mid_transfer_then_restarted(model_path) -> None:
    model = model_path("tiny")
    pre = Worker.prefill(model, *FAST)
    dec = Worker.decode(model, *FAST, peers=[pre])
    restarted = None
    try:
        pre.wait_ready()
        dec.wait_ready()
        os.killpg(pre.proc.pid, signal.SIGSTOP)  # prefill takes the request but never computes it
        body = {"text": "prefill dies " * 20, "sampling_params": SP, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": pre.bootstrap, "bootstrap_room": 31}
        _in_thread(pre.post, "/generate", body)  # its connection is reset by the kill
        fut = _in_thread(dec.post, "/generate", body)
        _wait(lambda: _raw_pd(dec)["rooms"] == 1 and _raw_pd(dec)["queued"] == 0)  # pages reserved
        t0 = time.monotonic()
        os.killpg(pre.proc.pid, signal.SIGKILL)
        d = fut.result(30)
        assert d.status_code == 503 and "is gone" in d.json()["error"]["message"], d.text
        assert time.monotonic() - t0 < 8  # heartbeat timeout 3 s
        _whole(dec)
        assert dec.get("/health/ready").status_code == 503  # no prefill peer now
        args = pre.proc.args[pre.proc.args.index("serve"):]
        port = args[args.index("--port") + 1]
        restarted = Worker(args, port=int(port))  # same ports: decode reconnects on its own
        restarted.bootstrap = pre.bootstrap
        restarted.wait_ready()
        _wait(lambda: dec.get("/health/ready").status_code == 200, timeout=30)
        again = pd_generate(restarted, dec, {"text": "after the restart", "sampling_params": SP})
        assert len(again["output_ids"]) == SP["max_new_tokens"]
        _whole(restarted, dec)
    finally:
        for w in (restarted, dec, pre):
            if w is not None:
                w.stop()


def test_decode_killed_mid_stream(pair, model_path) -> None:
    pre, _ = pair
    dec = Worker.decode(model_path("tiny"), *FAST, peers=[pre])
    try:
        dec.wait_ready()
        name = [p for p in _raw_pd(pre)["decode_peers"]]
        body = {"text": "decode dies " * 20, "sampling_params": {**SP, "max_new_tokens": 3000}, "rid": "dies"}
        _in_thread(pd_post, pre, dec, "/generate", body)
        _wait(lambda: dec.get("/debug/pool").json()["ranks"][0]["num_running"] == 1)
        os.killpg(dec.proc.pid, signal.SIGKILL)
        _wait(lambda: len(_raw_pd(pre)["decode_peers"]) < len(name), timeout=10)  # found dead
        _whole(pre)
    finally:
        dec.stop()
