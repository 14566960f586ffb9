"""Hostile and wrong peers around a real prefill + decode pair (real processes, CURVE with the
tests' PD secret): a request cannot make decode connect anywhere it was not configured to,
a fake prefill answering garbage cannot crash decode, and a fuzz campaign against the
prefill's bootstrap port leaves it serving. Each test ends with both pools whole."""

from __future__ import annotations

import random
import socket

import pytest
import zmq
from fake_prefill import FakePrefill
from hypothesis import HealthCheck, given, settings
from pd_client import pd_generate
from pd_frames import KILLERS, fuzz_one, identities, messages
from waits import wait_until
from worker_process import PD_SECRET, Worker

from tandem.pd import protocol as pd
from tandem.pd.control.auth import CurveKeys

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

FAST = ("--pd-heartbeat-interval", "0.5", "--pd-heartbeat-timeout", "3", "--pd-bootstrap-timeout", "4",
        "--pd-transfer-timeout", "8", "--max-total-tokens", "4096")
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(model_path):
    model = model_path("tiny")
    fake = FakePrefill()
    pre = Worker.prefill(model, *FAST)
    dec = Worker.decode(model, *FAST, peers=[pre, fake.key])
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec, fake
    finally:
        dec.stop()
        pre.stop()
        fake.close()


@pytest.fixture(autouse=True)
def still_serving(stack):
    """After each test: a PD request answers in full and both pools are whole."""
    yield
    pre, dec, _ = stack
    assert len(pd_generate(pre, dec, {"text": "still serving", "sampling_params": SP})["output_ids"]) == 8
    for w in (pre, dec):
        assert w.pool()["whole"], w.output()
        assert _pd(w)["control_alive"], w.output()


def _pd(w: Worker) -> dict:
    return w.get("/debug/pool").json()["ranks"][0]["pd"]


def _generate(dec: Worker, host: str, port: int):
    return dec.post("/generate", {"text": "where to?", "sampling_params": SP, "bootstrap_host": host,
                                  "bootstrap_port": port, "bootstrap_room": random.randrange(2**63)})


def test_decode_connects_only_to_its_configured_prefills(stack) -> None:
    pre, dec, fake = stack
    with socket.socket() as stray:  # a listener no request may make decode reach
        stray.bind(("127.0.0.1", 0))
        stray.listen()
        stray.settimeout(1.0)
        for host, port in (("*", pre.bootstrap), ("127.0.0.1", 1), ("127.0.0.1", stray.getsockname()[1]),
                           ("evil.example.com", pre.bootstrap), ("10.255.255.1", pre.bootstrap)):
            r = _generate(dec, host, port)
            assert r.status_code == 400 and "is not a prefill peer" in r.json()["error"]["message"], r.text
        with pytest.raises(TimeoutError):
            stray.accept()
    assert set(_pd(dec)["peers"]) <= {f"127.0.0.1:{pre.bootstrap}", fake.key}
    assert _pd(dec)["refused_addresses"] >= 5


def _after_a_fresh_hello(fake: FakePrefill, mode: str) -> None:
    """Switch the fake's answers, then wait until decode has handshaken again under them."""
    fake.mode, seen = mode, fake.hellos
    wait_until(lambda: fake.hellos > seen, 30, "decode to handshake again with its configured peer")


def test_a_fake_prefill_answering_garbage_cannot_crash_decode(stack) -> None:
    _, dec, fake = stack
    dropped = _pd(dec)["control_dropped"]
    for mode in ("empty", "garbage"):
        _after_a_fresh_hello(fake, mode)
        r = _generate(dec, "127.0.0.1", fake.port)
        assert r.status_code == 503 and "no handshake" in r.json()["error"]["message"], r.text
    assert _pd(dec)["control_dropped"] > dropped
    _after_a_fresh_hello(fake, "bad-agent")  # NIXL refuses the metadata: nixlMismatchError, once fatal
    r = _generate(dec, "127.0.0.1", fake.port)
    assert r.status_code == 503 and "agent" in r.json()["error"]["message"], r.text
    fake.mode = "silent"


def test_prefill_serves_on_after_a_fuzz_campaign(stack) -> None:
    pre, _, _ = stack
    ctx, endpoint, keys = zmq.Context(), f"tcp://127.0.0.1:{pre.bootstrap}", CurveKeys.from_secret(PD_SECRET)
    try:
        for frame in KILLERS:
            assert isinstance(fuzz_one(ctx, endpoint, b"\xff\xfekiller", [frame], keys), pd.HeartbeatAck)
        with pytest.raises(AssertionError, match="stopped answering"):  # no secret: not even an answer
            fuzz_one(ctx, endpoint, b"stranger", [pd.encode(pd.Heartbeat("x"))], None, 700)

        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(ident=identities, message=messages)
        def campaign(ident: bytes, message: list[bytes]) -> None:
            assert isinstance(fuzz_one(ctx, endpoint, ident, message, keys), pd.HeartbeatAck)

        campaign()
    finally:
        ctx.term()
    assert _pd(pre)["control_dropped"] >= len(KILLERS)


def _batch(pre: Worker, texts: list[str], **fields) -> dict:
    body = {"text": texts, "sampling_params": SP, "bootstrap_host": ["127.0.0.1"] * len(texts),
            "bootstrap_port": [pre.bootstrap] * len(texts), **fields}
    return body


def test_one_room_per_job_as_sgl_router_sends_it(stack) -> None:
    """sgl-router names each job of a batch (or of n choices) with its own room, in lists."""
    import concurrent.futures as cf

    pre, dec, _ = stack
    texts = [f"job {i} of the batch, long enough to be disaggregated " * 4 for i in range(3)]
    body = _batch(pre, texts, bootstrap_room=[random.randrange(2**63) for _ in texts])
    before = _pd(dec)["transferred"]
    with cf.ThreadPoolExecutor(2) as ex:
        p, d = ex.submit(pre.post, "/generate", body), ex.submit(dec.post, "/generate", body)
    assert p.result().status_code == 200 and d.result().status_code == 200, (p.result().text, d.result().text)
    assert _pd(dec)["transferred"] - before == len(texts)  # each job's KV came from the prefill
    singles = [pd_generate(pre, dec, {"text": t, "sampling_params": SP})["output_ids"] for t in texts]
    assert [o["output_ids"] for o in d.result().json()] == singles


@pytest.mark.parametrize("fields", [
    {"bootstrap_room": [1, 2]},  # two rooms for three jobs
    {"bootstrap_room": 5, "bootstrap_port": [1, 2, 3, 4]},
    {"bootstrap_room": list(range(5000))},  # past the bound on any list
])
def test_per_job_lists_of_the_wrong_length_are_400s(stack, fields) -> None:
    pre, dec, _ = stack
    body = _batch(pre, ["a", "b", "c"], **fields)
    for w in (pre, dec):
        r = w.post("/generate", body)
        assert r.status_code == 400 and "bootstrap" in r.text, r.text


def test_a_room_named_twice_in_one_request_fails_it_and_nothing_leaks(stack) -> None:
    """Two jobs claiming one room would pair one prefill's KV with two decodes: both sides
    refuse the request with a 400 before any job starts (the pools fixture checks the rest)."""
    import concurrent.futures as cf

    pre, dec, _ = stack
    room = random.randrange(2**63)
    body = _batch(pre, [f"twin {i} long enough to be disaggregated " * 4 for i in range(2)],
                  bootstrap_room=[room, room])
    with cf.ThreadPoolExecutor(2) as ex:
        p, d = ex.submit(pre.post, "/generate", body), ex.submit(dec.post, "/generate", body)
    for r in (p.result(), d.result()):
        assert r.status_code == 400, r.text
        assert "bootstrap_room" in r.text and "twice" in r.text
