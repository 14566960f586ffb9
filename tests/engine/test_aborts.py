"""Aborts and timeouts: of a waiting, running or chunked request, in both loops,
including an abort that lands between scheduling one chunk and processing the last."""

from __future__ import annotations

import pytest
from waits import wait_until

from tandem.engine.scheduler import admin
from tandem.protocol.messages import FlushCacheReq


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_waiting_running_and_chunked(engine, overlap: bool) -> None:
    eng = engine(max_total_tokens=4096, max_running_requests=2, chunked_prefill_size=16,
                 disable_overlap_schedule=not overlap)
    sp = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}  # far more than the test waits for
    running = eng.submit([1, 2, 3, 4], sp)
    chunked = eng.submit(list(range(10, 300)), sp)  # 290 tokens in 16-token chunks
    waiting = eng.submit([5, 6, 7], sp)  # max_running_requests=2: it waits
    # The first request's first token: it is decoding, the second is in its chunks (it shared
    # the first's prefill batch), the third waits for a slot.
    assert not running.next(timeout=60).finished
    for handle in (waiting, chunked, running):
        handle.abort()
    for handle in (waiting, chunked, running):
        _, last = handle.result(timeout=60)
        assert last.finish_reason["kind"] == "abort", handle.rid


def test_abort_lands_between_scheduling_a_chunk_and_processing_the_previous(engine) -> None:
    """Overlap, consecutive prefill: chunk N+1 is scheduled, then chunk N's result is
    processed before N+1 launches. An abort applied there finishes the request while
    N+1 is already built; N+1 must still run on the row it was scheduled with."""
    eng = engine(max_total_tokens=4096, max_running_requests=2, chunked_prefill_size=16)
    sched = eng.scheduler
    plain = sched.get_next_batch_to_run
    prompt = list(range(10, 300))
    chunks: list[int] = []

    def abort_after_third_chunk():  # runs on the scheduler thread, so the timing is exact
        batch = plain()
        ours = [r for r in batch.reqs if r.origin_input_ids == prompt] if batch is not None else []
        if ours and batch.mode.is_extend():
            chunks.append(len(chunks))
            if len(chunks) == 3:
                sched.abort(ours[0].rid)
        return batch

    sched.get_next_batch_to_run = abort_after_third_chunk
    _, last = eng.submit(prompt, {"max_new_tokens": 4, "temperature": 0}).result(timeout=60)
    assert last.finish_reason["kind"] == "abort"
    assert len(chunks) == 3
    sched.get_next_batch_to_run = plain
    assert len(eng.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})[0]["token_ids"]) == 3


def test_waiting_and_running_timeouts_abort(engine) -> None:
    eng = engine(max_total_tokens=4096, max_running_requests=1, waiting_timeout=0.2, running_timeout=1.0,
                 disable_overlap_schedule=True)
    # 3000 tokens take several seconds even in a fast phase of the machine (~1.5-4 ms
    # a token): the running timeout, not the length, must end the first request.
    sp = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
    runs, waits = eng.generate([[1, 2, 3], [4, 5, 6]], sp)
    assert runs["finish_reason"] == "abort" and "running_timeout" in runs["meta"]["finish_message"]
    assert waits["finish_reason"] == "abort" and "waiting_timeout" in waits["meta"]["finish_message"]
    assert waits["meta"]["completion_tokens"] == 0


def test_closing_a_stream_early_aborts_the_request(engine) -> None:
    eng = engine(max_total_tokens=2048)
    stream = eng.generate_stream([1, 2, 3], {"max_new_tokens": 500, "ignore_eos": True})
    next(stream)
    stream.close()
    # The abort lands at the request's next step; a flush says busy until then.
    wait_until(lambda: all(r.ok for r in eng.flush_cache()), 10, "the closed stream's request to end")


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_flush_right_after_a_prefill_is_busy_not_fatal(engine, overlap: bool) -> None:
    """Between processing a prefill batch and merging its requests into the running
    set, the requests are in neither queue; a flush landing there must say busy."""
    eng = engine(max_total_tokens=2048, disable_overlap_schedule=not overlap)
    sched = eng.scheduler
    plain = sched.process_batch_result
    replies = []

    def flush_after_prefill(batch, result):  # on the scheduler thread: exact timing
        plain(batch, result)
        if batch.mode.is_extend() and not replies:
            replies.append(admin.flush_cache(sched, FlushCacheReq("probe")))

    sched.process_batch_result = flush_after_prefill
    out = eng.generate([1, 2, 3], {"max_new_tokens": 5, "ignore_eos": True})[0]
    assert len(out["token_ids"]) == 5
    assert replies and not replies[0].ok and "busy" in replies[0].info["error"]
