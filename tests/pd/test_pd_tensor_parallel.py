"""PD between tensor-parallel workers (issue 29): a TP=2 prefill feeding a TP=2 decode (each
prefill rank writes its decode twin's heads) and a TP=1 decode (both prefill ranks write
halves of its heads, into staging pages decode then scatters: decode/staging.py), and a TP=1
prefill feeding the TP=2 decode (its one rank writes both, each half staged into whole pages
first: prefill/staging.py), token-identical to the offline TP=1 Engine, every rank's pool
whole on both sides after each test. A cancel mid-transfer crosses both TP groups' ticks and
frees every rank's pages; a TP decode killed mid-stream is found dead (through the TP
prefill's tick). The TP workers run with the step digest on: a rank deciding apart from
rank 0 would stop its worker."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal

import pytest
from pd_client import pd_generate, pd_stats
from waits import wait_until
from worker_process import Worker, running

from tandem import Engine

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

SP = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
FLAGS = ("--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "4096",
         "--pd-heartbeat-interval", "0.5", "--pd-heartbeat-timeout", "3")
TP2 = ("--tp-size", "2", "--debug-tp-digest")  # a rank stepping apart from rank 0 stops the worker
# A short one, one in 5 chunk sends (decode rooms complete on every rank only after the last),
# and a page-aligned one; sent together, so rooms complete on the ranks in different orders.
PROMPTS = ["hi", "the quick brown fox jumps " * 60, "sixteen tokens of text " * 4, "one two three " * 21]


@pytest.fixture(scope="module")
def stack(model_path):
    model = model_path("tiny")
    pre = Worker.prefill(model, *FLAGS, *TP2)
    pre1 = Worker.prefill(model, *FLAGS)
    dec2 = Worker.decode(model, *FLAGS, *TP2, "--pd-local-prefill-threshold", "0", peers=[pre, pre1])
    dec1 = Worker.decode(model, *FLAGS, "--pd-local-prefill-threshold", "0", peers=[pre])
    with running(pre, dec2, dec1, pre1) as workers:
        yield workers


@pytest.fixture(scope="module")
def want(model_path) -> list[list[int]]:
    with Engine(str(model_path("tiny")), dtype="float32", page_size=16, chunked_prefill_size=64,
                max_total_tokens=4096) as eng:
        return [r["token_ids"] for r in eng.generate(PROMPTS, SP)]


@pytest.fixture(autouse=True)
def pools_whole(stack):
    yield
    for w in stack:
        pool = w.pool()
        assert pool["whole"], w.output()
        ranks = pool["ranks"][0]["tp_ranks"]
        assert all(r["free_tokens"] + r["cached_tokens"] == r["capacity_tokens"] for r in ranks), ranks
        assert all(r["free_tokens"] == ranks[0]["free_tokens"] for r in ranks), ranks  # the ranks agree


def _generate(pre: Worker, dec: Worker) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = ex.map(lambda p: pd_generate(pre, dec, {"text": p, "sampling_params": SP}), PROMPTS)
        return [r["output_ids"] for r in got]


def test_tp2_prefill_to_tp2_decode_matches_one_rank(stack, want) -> None:
    pre, dec2, _, _ = stack
    sends = pd_stats(pre)[0]["sends"]
    assert _generate(pre, dec2) == want
    assert pd_stats(pre)[0]["sends"] - sends >= 5 + len(PROMPTS)  # the long prompt went chunk by chunk
    assert len(dec2.pool()["ranks"][0]["tp_ranks"]) == 2
    assert pd_stats(dec2)[0]["transferred"] >= len(PROMPTS) and pd_stats(dec2)[0]["failed"] == 0


def test_tp2_prefill_to_tp1_decode_matches_one_rank(stack, want) -> None:
    pre, _, dec1, _ = stack
    assert _generate(pre, dec1) == want
    stats = pd_stats(dec1)[0]
    assert stats["transferred"] >= len(PROMPTS) and stats["failed"] == 0
    # Each prefill rank's half went into staging pages decode reserved, then into the room's pages.
    assert stats["scattered_rooms"] >= len(PROMPTS) and stats["unstaged_rooms"] == 0
    assert all(r["scatter_sends"] >= len(PROMPTS) and r["unstaged_sends"] == 0 for r in pd_stats(pre))


def test_tp1_prefill_to_tp2_decode_matches_one_rank(stack, want) -> None:
    _, dec2, _, pre1 = stack
    staged = pd_stats(pre1)[0]["staged_sends"]
    assert _generate(pre1, dec2) == want
    stats = pd_stats(pre1)[0]
    assert stats["failed"] == 0
    # Each send's half for each decode rank went through the staging buffer, none as slices
    # (how many sends: decode may hold prompt prefixes from the tests before).
    assert stats["staged_sends"] - staged >= 2 * len(PROMPTS) and stats["unstaged_sends"] == 0


def test_abort_while_transferring_frees_every_ranks_pages(stack) -> None:
    pre, dec2, _, _ = stack
    body = {"text": "cancel me mid transfer " * 10, "sampling_params": SP, "rid": "tp-xfer-abort",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pre.bootstrap, "bootstrap_room": random.randrange(2**63)}

    def rooms(w: Worker) -> tuple[int, int]:  # now, not once idle (as pd_stats waits to)
        state = w.get("/debug/pool").json()["ranks"][0]["pd"]
        return state["rooms"], state["queued"]

    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(dec2.post, "/generate", body)  # decode reserves pages; prefill has no request yet
        wait_until(lambda: rooms(dec2) == (1, 0), 15, "pages reserved", interval=0.05)
        assert dec2.admin("POST", "/abort_request", {"rid": "tp-xfer-abort"}).json()["aborted"]
        assert fut.result(10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until(lambda: rooms(dec2)[0] == 0, 15, "prefill confirmed the cancel", interval=0.05)
    late = pre.post("/generate", body).json()  # the request reaches prefill after the cancel
    assert "cancelled by decode" in late["meta_info"]["finish_reason"]["message"]


def test_a_dead_tp_decode_is_forgotten_by_the_tp_prefill(stack, model_path) -> None:
    pre = stack[0]
    dec = Worker.decode(model_path("tiny"), *FLAGS, *TP2, peers=[pre])
    try:
        dec.wait_ready()
        peers = len(pd_stats(pre)[0]["decode_peers"])
        body = {"text": "decode dies " * 20, "sampling_params": {**SP, "max_new_tokens": 3000}, "rid": "tp-dies",
                "bootstrap_host": "127.0.0.1", "bootstrap_port": pre.bootstrap,
                "bootstrap_room": random.randrange(2**63)}
        with cf.ThreadPoolExecutor(2) as ex:
            ex.submit(pre.post, "/generate", body)
            ex.submit(dec.post, "/generate", body)
            wait_until(lambda: dec.get("/debug/pool").json()["ranks"][0]["num_running"] == 1, 30, "decoding")
            os.killpg(dec.proc.pid, signal.SIGKILL)
        wait_until(lambda: len(pd_stats(pre)[0]["decode_peers"]) < peers, 15, "the dead decode forgotten")
    finally:
        dec.stop()
