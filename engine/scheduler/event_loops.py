"""The scheduler's two event loops, side by side, as the diagram reads:

    normal loop:   recv -> schedule N -> run N -> process N
    overlap loop:  recv -> schedule N -> launch N -> process N-1 -> (N in flight)

The overlap loop follows SGLang's overlap scheduler: while the forward thread computes batch
N, this thread processes N-1's results and builds N+1 (whose decode inputs are N's futures).
Two consecutive prefills do not overlap, so the first prefill's tokens reach the client
before the second runs. A constrained batch N is sampled only after N-1 is processed: its
vocabulary mask needs N-1's tokens (engine/grammar/batch_mask.py). What processing N-1 frees
(rows, pages, the cached path of a finished request) is held until N has completed: N may
still write it (scheduler/cache_manager.py). Both loops give the same tokens
(tests/engine/test_scheduler_vs_hf.py, test_structured_output.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.engine.scheduler.grammar_manager import fill_or_fail

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler


def run(s: Scheduler) -> None:
    """Run the scheduler's loop until shutdown (the caller's thread or process)."""
    # An Engine built inside a caller's inference_mode has pools only inference mode may update.
    try:
        with torch.inference_mode():
            if s.overlap is not None:
                event_loop_overlap(s)
            else:
                event_loop_normal(s)
            # A shutdown: what still runs ends with an answer. Not after a fault the loop did not
            # contain (the pools may be inconsistent): the worker's front reports that one.
            s.end_all()
    finally:
        s.close()


def event_loop_normal(s: Scheduler) -> None:
    while s.running:
        s.process_input_requests(s.recv_requests(block=s.idle()))
        # Nothing launched still runs: rows held since the last result are reusable, also
        # those of a batch that failed and so never had its result processed.
        s.cache.reclaim()
        t0 = time.perf_counter()
        batch = s.faults.build(s.get_next_batch_to_run)
        t1 = time.perf_counter()
        if batch is not None:
            with s.faults.contain(batch.reqs):
                result = s.run_batch(batch)
                t2 = time.perf_counter()
                s.process_batch_result(batch, result)
                batch.output_ids = np.array(result.next_token_ids, dtype=np.int64)
                s.metrics.on_overhead(batch, (t1 - t0) + (time.perf_counter() - t2))
        else:
            s.self_check_during_idle()
        s.last_batch = batch

def event_loop_overlap(s: Scheduler) -> None:
    assert s.overlap is not None  # invariant: the overlap loop runs only with its state built
    in_flight = s.in_flight

    def pop_and_process() -> None:
        done_batch, fut = in_flight.popleft()
        with s.faults.contain(done_batch.reqs):
            result = fut.result()  # the forward's exception, if it raised
            t = time.perf_counter()
            s.process_batch_result(done_batch, result)
            s.metrics.on_overhead(done_batch, time.perf_counter() - t)

    while s.running:
        while in_flight and s.all_finished():
            pop_and_process()  # only finished requests' steps: settle them before a flush looks
        if not in_flight:
            # Nothing launched still runs: what is held is reusable, also a failed batch's rows,
            # which no result reclaims (admission would otherwise turn requests away for ever).
            s.cache.reclaim()
        s.process_input_requests(s.recv_requests(block=s.idle()))
        t = time.perf_counter()
        batch = s.faults.build(s.get_next_batch_to_run)
        s.metrics.on_overhead(batch, time.perf_counter() - t)
        consecutive_prefill = (
            batch is not None and batch.mode.is_extend()
            and s.last_batch is not None and s.last_batch.mode.is_extend()
        )
        # Snapshot the batch before processing N-1: that may finish (abort) one of its
        # requests, and the batch must still run as scheduled.
        mwb = s.faults.build(batch.get_model_worker_batch) if batch is not None else None
        batch = batch if mwb is not None else None
        if consecutive_prefill and in_flight:
            pop_and_process()
        mask = None
        if batch is not None:
            with s.faults.contain(batch.reqs):
                s.record_step(batch, mwb)
                mask = s.grammar.attach_mask(batch.reqs, mwb)
                fut, future_ids = s.overlap.launch(mwb)
                batch.output_ids = future_ids  # the next decode step feeds these in
                in_flight.append((batch.snapshot(), fut))
        try:
            if in_flight and (len(in_flight) > 1 or batch is None):
                pop_and_process()
            elif batch is None and not in_flight:
                s.self_check_during_idle()
        finally:
            if mask is not None:  # only N is in flight now: every matcher is current
                fill_or_fail(mask)
        s.last_batch = batch
    while in_flight:
        pop_and_process()
    s.cache.reclaim()
