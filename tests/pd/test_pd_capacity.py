"""What a prefill takes on is bounded by what it has, never asserted (real processes):

- capacity: two decodes that can hold more requests than their prefill has first-token
  slots send a burst of six times those slots. Prefill takes a slot when it accepts a
  KVDest, a KVDest without one waits in order, and each decode keeps at most the prefill's
  slots in transfer. Every request answers with the tokens decode computes for it itself.
- bounds: a peer holding the secret (tests/support/fake_decode.py) names pages or a slot
  outside what its handshake declared. That request fails alone, before it is computed,
  and the peer is told why. One whose handshake lied about its pool fails at the send
  (NIXL refuses it), alone too: that once freed the request's slot twice and ended prefill.

Each test ends with a PD request answering and every pool whole; prefill never exits."""

from __future__ import annotations

import concurrent.futures as cf
import random

import pytest
from pd_client import pd_generate, pd_stats
from worker_process import Worker, running

from tandem.pd import protocol as pd

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

FAST = ("--pd-heartbeat-interval", "0.5", "--pd-heartbeat-timeout", "5", "--max-total-tokens", "8192")
SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PREFILL_SLOTS = 2
BURST = 12  # six times prefill's slots


@pytest.fixture(scope="module")
def stack(model_path):
    model = model_path("tiny")
    pre = Worker.prefill(model, *FAST, "--max-running-requests", str(PREFILL_SLOTS))
    decs = [Worker.decode(model, *FAST, "--max-running-requests", "16", "--disable-radix-cache", peers=[pre])
            for _ in range(2)]
    with running(pre, *decs):
        yield model, pre, decs


@pytest.fixture(autouse=True)
def still_serving(stack):
    yield
    _, pre, decs = stack
    assert len(pd_generate(pre, decs[0], {"text": "still serving " * 10, "sampling_params": SP})["output_ids"]) == 4
    assert pre.proc.poll() is None, pre.output()
    for w in (pre, *decs):
        assert w.pool()["whole"], w.output()


def test_a_burst_beyond_prefills_slots_waits_and_completes(stack) -> None:
    _, pre, decs = stack
    prompts = [f"request {i} of a burst larger than the prefill worker's first-token slots " * 3
               for i in range(BURST)]
    with cf.ThreadPoolExecutor(BURST) as ex:
        got = list(ex.map(lambda i: pd_generate(pre, decs[i % 2], {"text": prompts[i], "sampling_params": SP}),
                          range(BURST)))
    assert pre.proc.poll() is None, pre.output()
    stats = pd_stats(pre)[0]
    assert stats["failed"] == 0 and stats["slot_timeouts"] == 0, stats
    assert stats["slot_waits"] > 0, stats  # two decodes' rooms did outrun prefill's slots
    assert sum(pd_stats(d)[0]["held_for_prefill_slots"] for d in decs) > 0  # and each decode held back
    assert sum(pd_stats(d)[0]["transferred"] for d in decs) >= BURST
    # The same prompts prefilled on decode itself, from scratch (no radix cache there)
    local = [decs[i % 2].post("/generate", {"text": prompts[i], "sampling_params": SP}).json() for i in range(BURST)]
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in local]


PROMPT = list(range(5, 45))  # 40 tokens: 40 pages of decode's at page size 1


@pytest.mark.parametrize("dest", [
    {"pages": [*range(1, 40), 10**6]},  # a page past decode's pool
    {"pages": [0, *range(2, 41)]},  # page 0, decode's pad page
    {"slot": 9},  # a first-token slot past decode's 4
], ids=["page", "pad-page", "slot"])
def test_a_kvdest_outside_decodes_bounds_fails_its_request_alone(stack, dest) -> None:
    from fake_decode import FakeDecode

    model, pre, _ = stack
    fake = FakeDecode(model, pre.bootstrap)
    try:
        fake.handshake()
        sends = pd_stats(pre)[0]["sends"]
        room = random.randrange(2**63)
        fake.send(pd.KVDest(room, **{"pages": list(range(1, 41)), "skip": 0, "slot": 0,
                                     "prompt_len": len(PROMPT), **dest}))
        r = pre.post("/generate", {"input_ids": PROMPT, "sampling_params": SP, "bootstrap_host": "127.0.0.1",
                                   "bootstrap_port": pre.bootstrap, "bootstrap_room": room})
        assert r.status_code == 503 and "KVDest does not fit" in r.json()["error"]["message"], r.text
        told = fake.wait_for(pd.KVCancel)
        assert told.room == room and "outside decode's" in told.reason, told
        assert pd_stats(pre)[0]["sends"] == sends  # refused before it was computed: nothing went out
    finally:
        fake.close()


def test_a_send_refused_after_the_first_token_fails_its_request_alone(stack) -> None:
    """The pages fit the pool decode declared, not the one it registered: NIXL refuses the
    last chunk's write after the request has finished on prefill."""
    from fake_decode import FakeDecode

    model, pre, _ = stack
    fake = FakeDecode(model, pre.bootstrap, declared_pages=10_000)
    try:
        fake.handshake()
        room = random.randrange(2**63)
        fake.send(pd.KVDest(room, list(range(5000, 5040)), 0, 0, len(PROMPT)))
        pre.post("/generate", {"input_ids": PROMPT, "sampling_params": SP, "bootstrap_host": "127.0.0.1",
                               "bootstrap_port": pre.bootstrap, "bootstrap_room": room})
        told = fake.wait_for(pd.KVCancel)
        assert told.room == room and "KV send refused" in told.reason, told
        assert pd_stats(pre)[0]["failed"] >= 1
    finally:
        fake.close()
