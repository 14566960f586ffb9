"""One hostile request must never take a worker down, through a real `tandem serve`:
every unbounded value is a 400 and the worker goes on serving; a client's rid is only its
name, so reusing it right after a disconnect or an abort reaches the new request; and a worker
whose scheduler died exits (non-zero) instead of lingering on 503s. Each ends with the pool
whole, checked from outside."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from waits import wait_until
from worker_process import Worker

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
CMPL = {"model": "tiny", "prompt": "x"}


def _gen(**sampling: object) -> dict:
    return {"text": "x", "sampling_params": {"max_new_tokens": 2, **sampling}}


HOSTILE = [
    ("/generate", _gen(top_k=2**63)), ("/generate", _gen(top_k=10**26)), ("/generate", _gen(top_k=2**20 + 1)),
    ("/generate", _gen(seed=2**64)), ("/generate", _gen(max_new_tokens=10**26)),
    ("/generate", _gen(stop_token_ids=[2**31])), ("/generate", _gen(stop_token_ids=list(range(1025)))),
    ("/generate", _gen(stop=["a"] * 17)), ("/generate", _gen(stop="a" * 1025)), ("/generate", _gen(stop=[""])),
    ("/generate", {"text": "x", "logprob_start_len": 10**26}), ("/generate", {"text": "x", "rid": "r" * 257}),
    ("/generate", {"text": ["x"] * 4097}), ("/generate", {"text": "x", "top_logprobs_num": 10**6}),
    ("/v1/completions", {**CMPL, "top_k": 2**63}), ("/v1/completions", {**CMPL, "max_tokens": 10**26}),
    ("/v1/completions", {**CMPL, "n": 1000}), ("/v1/completions", {**CMPL, "logprobs": 10**6}),
    ("/v1/completions", {**CMPL, "best_of": 10**26}), ("/v1/completions", {**CMPL, "seed": 2**64}),
    ("/v1/completions", {**CMPL, "logit_bias": {str(i): 1.0 for i in range(2000)}}),
    ("/v1/completions", {**CMPL, "prompt": "x" * (4 * 2**20 + 1)}),
    ("/v1/completions", {**CMPL, "prompt": ["x"] * 100, "n": 64}),  # prompts x n past MAX_CHOICES
    ("/v1/completions", {**CMPL, "prompt": ["x"] * 50, "n": 64}),  # past a quarter of the worker's slots
    ("/v1/chat/completions", {**CHAT, "top_k": 10**26}), ("/v1/chat/completions", {**CHAT, "n": 65}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**26}),
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 4097}),
]
# JSON that json.loads takes but is no number: refused where it enters, whatever the field.
RAW = [
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": NaN}}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": NaN}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"temperature": Infinity}'),
]


def test_hostile_bodies_are_refused_and_the_worker_serves_on(worker) -> None:
    """Before the bounds, /generate with top_k=2**63 overflowed the sampler's int64 tensor in the
    scheduler's forward: the loop ended and the worker answered 503 from then on."""
    for path, body in HOSTILE:
        r = worker.post(path, body)
        assert r.status_code == 400, (path, str(body)[:120], r.text[:300])
    for path, raw in RAW:
        r = httpx.post(worker.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, raw, r.text[:300])
    # A top_k past the vocabulary but within the bound samples from the whole vocabulary.
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    whole = worker.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sampled}).json()["output_ids"]
    big_k = worker.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {**sampled, "top_k": 2**20}})
    assert big_k.status_code == 200 and big_k.json()["output_ids"] == whole
    assert worker.get("/health").status_code == 200
    assert worker.pool()["whole"]


def _reference(worker: Worker, ids: list[int]) -> list[int]:
    return worker.post("/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()["output_ids"]


def test_a_reused_rid_reaches_the_new_request(worker) -> None:
    """The rid was the scheduler's key: reused right after a disconnect it could pop the old
    request's state, crash the idle integrity check, or deliver one client's tokens to another."""
    ref = _reference(worker, [9, 10, 11])
    short = {"input_ids": [9, 10, 11], "rid": "dup", "sampling_params": GREEDY}
    for round_ in range(3):
        with httpx.stream("POST", worker.url + "/generate", timeout=60, json={
                "input_ids": [1, 2, 3], "rid": "dup", "sampling_params": LONG, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 2:  # in flight: its rid is taken
                    assert worker.post("/generate", short).status_code == 400
                if n >= 4:
                    break  # the client goes away mid-stream: its request is aborted
        again = worker.post("/generate", short)
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == ref and again.json()["meta_info"]["id"] == "dup", round_
    # Aborted by its rid, then the rid reused at once.
    done: list[httpx.Response] = []
    t = threading.Thread(target=lambda: done.append(worker.post(
        "/generate", {"input_ids": [1, 2, 3], "rid": "dup2", "sampling_params": LONG})))
    t.start()
    wait_until(lambda: worker.admin("POST", "/abort_request", {"rid": "dup2"}).json()["aborted"], 10,
               "the first dup2 in flight, then aborted")
    reused = worker.post("/generate", {**short, "rid": "dup2"})
    t.join(60)
    assert done[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert reused.status_code == 200 and reused.json()["output_ids"] == ref
    assert worker.get("/health").status_code == 200
    assert worker.pool()["whole"]


def _scheduler_pid(pid: int) -> int:
    children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return next(c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text())


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "in-flight"])
def test_a_worker_whose_scheduler_died_exits(model_path, in_flight: bool) -> None:
    """Kubernetes and `tandem up --restart` replace a worker that exits; one that lingers
    answering 503 is never replaced."""
    w = Worker.colocated(model_path("tiny")).wait_ready()
    try:
        answers: list[object] = []

        def ask() -> None:
            try:
                answers.append(w.post("/generate", {"text": "x", "sampling_params": LONG}).status_code)
            except httpx.HTTPError as exc:  # the worker may close first; never a hang
                answers.append(exc)

        asker = threading.Thread(target=ask)
        if in_flight:
            asker.start()
            w.wait_running(1)
        os.kill(_scheduler_pid(w.proc.pid), signal.SIGKILL)

        def not_live() -> bool:  # liveness fails at once: 503 while it stops, then nothing listens
            try:
                return w.get("/health").status_code != 200
            except httpx.HTTPError:
                return True

        wait_until(not_live, 2, "/health to fail with the scheduler dead")
        assert w.proc.wait(15) == 70, w.output()
        if in_flight:
            asker.join(30)
            assert answers and answers[0] != 200, answers
        assert "the scheduler died" in w.output()
    finally:
        w.stop()
