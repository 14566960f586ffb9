"""The check every engine test ends with: the scheduler still runs and its pools are whole;
and a way to hand the scheduler several requests in one receive."""

from __future__ import annotations

import threading
from typing import Any

from tandem import Engine


def assert_whole(eng: Engine) -> None:
    """No scheduler error, and a flush (which needs the engine idle) finds every KV page free
    and the integrity check passed: free + cached + in-use pages add up, no lock leaked."""
    assert eng.error is None, f"the scheduler stopped: {eng.error!r}"
    for reply in eng.flush_cache():
        assert reply.ok, reply.info
        assert reply.info["free_tokens"] == reply.info["capacity_tokens"], reply.info


def submit_together(eng: Engine, jobs: list[tuple[list[int], dict]]) -> list[tuple[list[int], Any]]:
    """Submit `jobs` while the loop waits at a gate, so that it receives them in one go: the
    first max_running_requests of them share a batch. Each job's tokens and last output."""
    sched = eng.scheduler
    plain, at_gate, gate = sched.recv_requests, threading.Event(), threading.Event()
    sched.recv_requests = lambda block: (at_gate.set(), gate.wait(), plain(block))[2]
    assert at_gate.wait(30), "the scheduler loop never came back to receive"
    handles = [eng.submit(ids, sp) for ids, sp in jobs]
    del sched.recv_requests
    gate.set()
    return [h.result(timeout=60) for h in handles]
