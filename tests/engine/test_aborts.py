"""Aborts and timeouts: of a waiting, running or chunked request, in both loops,
including an abort that lands between scheduling one chunk and processing the last."""

from __future__ import annotations

import time

import pytest

from tandem import Engine
from tandem.engine.scheduler import admin
from tandem.protocol.messages import FlushCacheReq


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_waiting_running_and_chunked(model_path, overlap: bool) -> None:
    eng = Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=4096, max_running_requests=2,
                 chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    try:
        # Far more tokens than 0.3 s of decode reaches in any phase of the machine.
        sp = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
        running = eng._submit([1, 2, 3, 4], sp)
        chunked = eng._submit(list(range(10, 300)), sp)  # 290 tokens in 16-token chunks
        waiting = eng._submit([5, 6, 7], sp)  # max_running_requests=2: it waits
        time.sleep(0.3)
        for rid, _, _ in (waiting, chunked, running):
            eng.abort(rid)
        for rid, q, _ in (waiting, chunked, running):
            last = eng._get(q, timeout=60)
            while not last.finished:
                last = eng._get(q, timeout=60)
            assert last.finish_reason["kind"] == "abort", rid
            eng._close(rid)
        assert all(r.ok for r in eng.flush_cache())
    finally:
        eng.shutdown()


def test_abort_lands_between_scheduling_a_chunk_and_processing_the_previous(model_path) -> None:
    """Overlap, consecutive prefill: chunk N+1 is scheduled, then chunk N's result is
    processed before N+1 launches. An abort applied there finishes the request while
    N+1 is already built; N+1 must still run on the row it was scheduled with."""
    eng = Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=4096, max_running_requests=2,
                 chunked_prefill_size=16)
    sched = eng._backend.scheduler
    plain = sched.get_next_batch_to_run
    chunks: list[int] = []

    def abort_after_third_chunk():  # runs on the scheduler thread, so the timing is exact
        batch = plain()
        if batch is not None and batch.mode.is_extend() and any(r.rid == rid for r in batch.reqs):
            chunks.append(len(chunks))
            if len(chunks) == 3:
                sched.abort(rid)
        return batch

    sched.get_next_batch_to_run = abort_after_third_chunk
    try:
        rid, q, _ = eng._submit(list(range(10, 300)), {"max_new_tokens": 4, "temperature": 0})
        last = eng._get(q, timeout=60)
        while not last.finished:
            last = eng._get(q, timeout=60)
        assert last.finish_reason["kind"] == "abort"
        eng._close(rid)
        assert len(chunks) == 3
        sched.get_next_batch_to_run = plain
        assert len(eng.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})[0]["token_ids"]) == 3
        assert eng._backend.error is None
        assert all(r.ok for r in eng.flush_cache())
    finally:
        eng.shutdown()


def test_waiting_and_running_timeouts_abort(model_path) -> None:
    eng = Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=4096, max_running_requests=1,
                 waiting_timeout=0.2, running_timeout=1.0, disable_overlap_schedule=True)
    try:
        # 3000 tokens take several seconds even in a fast phase of the machine (~1.5-4 ms
        # a token): the running timeout, not the length, must end the first request.
        sp = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
        runs, waits = eng.generate([[1, 2, 3], [4, 5, 6]], sp)
        assert runs["finish_reason"] == "abort" and "running_timeout" in runs["meta"]["finish_message"]
        assert waits["finish_reason"] == "abort" and "waiting_timeout" in waits["meta"]["finish_message"]
        assert waits["meta"]["completion_tokens"] == 0
        assert all(r.ok for r in eng.flush_cache())
    finally:
        eng.shutdown()


def test_closing_a_stream_early_aborts_the_request(model_path) -> None:
    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=2048) as eng:
        stream = eng.generate_stream([1, 2, 3], {"max_new_tokens": 500, "ignore_eos": True})
        next(stream)
        stream.close()
        for _ in range(100):  # the abort lands at the request's next step
            replies = eng.flush_cache()
            if all(r.ok for r in replies):
                break
            time.sleep(0.05)
        assert all(r.ok for r in replies), replies


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_flush_right_after_a_prefill_is_busy_not_fatal(model_path, overlap: bool) -> None:
    """Between processing a prefill batch and merging its requests into the running
    set, the requests are in neither queue; a flush landing there must say busy."""
    eng = Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=2048,
                 disable_overlap_schedule=not overlap)
    sched = eng._backend.scheduler
    plain = sched.process_batch_result
    replies = []

    def flush_after_prefill(batch, result):  # on the scheduler thread: exact timing
        plain(batch, result)
        if batch.mode.is_extend() and not replies:
            replies.append(admin.flush_cache(sched, FlushCacheReq("probe")))

    sched.process_batch_result = flush_after_prefill
    try:
        out = eng.generate([1, 2, 3], {"max_new_tokens": 5, "ignore_eos": True})[0]
        assert len(out["token_ids"]) == 5
        assert replies and not replies[0].ok and "busy" in replies[0].info["error"]
        assert eng._backend.error is None
        assert all(r.ok for r in eng.flush_cache())
    finally:
        eng.shutdown()
