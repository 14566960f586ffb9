"""One hostile request must never take the scheduler down.

Hostile values are refused alone, before any batch (request_validation.py); a fault injected
into a batch (building it, its forward, processing its results) fails that batch's requests
alone, in both loops, and the requests after it get the tokens a clean run gives
(batch_faults.py); a fault that leaves the device or pools unknown still ends the scheduler.
Every scenario ends with the pool whole (flush_cache runs the integrity check)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from engine_checks import assert_whole, submit_together

from tandem import Engine

BAD_SEED = 4242  # the marker of the request whose batches fail
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = {"good": [5, 6, 7, 8, 9], "bad": [11, 12, 13], "later": [20, 21, 22, 23]}


@pytest.fixture(scope="module", params=[False, True], ids=["normal", "overlap"])
def shared(request, model_path):
    """One engine per loop for the module's fault tests, and the clean run's tokens."""
    eng = Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=4096, max_running_requests=2,
                 disable_overlap_schedule=not request.param)
    try:
        refs = {name: eng.generate(ids, GREEDY)[0]["token_ids"] for name, ids in PROMPTS.items()}
        yield eng, refs
    finally:
        eng.shutdown()


def _inject(sched: Any, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every batch holding the BAD_SEED request fail at `stage` (after a few tokens for
    the later stages, so that the failure lands mid-stream)."""
    bad = lambda params: any(p.seed == BAD_SEED for p in params)  # noqa: E731
    if stage in ("prefill", "decode"):
        forward = sched.worker.forward_batch_generation
        seen = [0]

        def failing_forward(mwb, *args, **kw):  # on the forward thread under overlap
            if bad(mwb.sampling_params):
                seen[0] += 1
                if stage == "prefill" or seen[0] >= 4:
                    raise ValueError("injected forward fault")
            return forward(mwb, *args, **kw)

        monkeypatch.setattr(sched.worker, "forward_batch_generation", failing_forward)
    elif stage in ("rows", "slots"):  # writing a new request's row: its cached prefix, then its new slots
        pool = sched.cache.req_to_token_pool
        write = pool.write

        def failing_write(row, col, values):
            holder = [r for r in sched.reqs.values() if r.req_pool_idx == row]
            prefix_write = bool(holder) and values is holder[0].prefix_indices
            if holder and holder[0].sampling_params.seed == BAD_SEED and prefix_write == (stage == "rows"):
                raise ValueError("injected row-write fault")
            return write(row, col, values)

        monkeypatch.setattr(pool, "write", failing_write)
    elif stage == "build":
        alloc = sched.cache.alloc_decode

        def failing_alloc(reqs):
            if bad([r.sampling_params for r in reqs]) and min(len(r.output_ids) for r in reqs) >= 3:
                raise ValueError("injected build fault")
            return alloc(reqs)

        monkeypatch.setattr(sched.cache, "alloc_decode", failing_alloc)
    else:
        check = sched.output.check_finished

        def failing_check(req, token):
            if req.sampling_params.seed == BAD_SEED and len(req.output_ids) >= 3:
                raise ValueError("injected process fault")
            return check(req, token)

        monkeypatch.setattr(sched.output, "check_finished", failing_check)


@pytest.mark.parametrize("stage", ["prefill", "decode", "build", "process", "rows", "slots"])
def test_a_failing_batch_fails_alone(shared, stage: str, monkeypatch) -> None:
    """rows / slots: writing the batch's request rows fails part-way (a row allocated for a
    request whose write never ran leaked before; so did slots no row recorded yet)."""
    eng, refs = shared
    _inject(eng.scheduler, stage, monkeypatch)
    bad = {**GREEDY, "seed": BAD_SEED}
    # good and bad share every batch (max_running_requests=2); later waits for a slot.
    (good_ids, good), (bad_ids, bad_out), (later_ids, later) = submit_together(
        eng, [(PROMPTS["good"], GREEDY), (PROMPTS["bad"], bad), (PROMPTS["later"], GREEDY)])
    for ids, out, name in ((good_ids, good, "good"), (bad_ids, bad_out, "bad")):
        assert out.finish_reason["kind"] == "abort" and "injected" in out.finish_reason["message"], out
        assert out.finish_reason["status"] == 500
        assert ids == refs[name][: len(ids)], "the tokens sent before the fault are the clean run's"
        assert (len(ids) > 0) == (stage not in ("prefill", "rows", "slots")), "the fault lands mid-stream"
    assert later_ids == refs["later"] and later.finish_reason["kind"] == "length"
    again = eng.generate([PROMPTS["good"], PROMPTS["later"]], GREEDY)
    assert [r["token_ids"] for r in again] == [refs["good"], refs["later"]]
    assert eng.scheduler.faults.failed_batches >= 1
    assert_whole(eng)


HOSTILE = [
    {"top_k": 2**63}, {"top_k": 10**26}, {"top_k": "5"}, {"seed": 2**63}, {"seed": -1},
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")},
    {"min_p": float("nan")}, {"max_new_tokens": 2**31}, {"max_new_tokens": 10**26},
    {"stop_token_ids": [2**31]}, {"stop_token_ids": list(range(2000))}, {"stop": [""]},
    {"stop": ["x"] * 17}, {"stop": "x" * 2000}, {"top_logprobs_num": 10**6}, {"ignore_eos": "yes"},
]


def test_hostile_values_are_refused_alone(shared) -> None:
    """Before the fix, top_k=2**63 overflowed the sampler's int64 tensor inside the forward and
    the exception ended the scheduler loop."""
    eng, refs = shared
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    jobs = [(PROMPTS["good"], {**sampled, **bad}) for bad in HOSTILE]
    jobs += [([1.5, 2], GREEDY), ([10**26], GREEDY), (["a"], GREEDY), ([-1], GREEDY)]
    results = eng.generate([ids for ids, _ in jobs], [sp for _, sp in jobs])
    for (ids, sp), r in zip(jobs, results):
        assert r["finish_reason"] == "abort" and r["token_ids"] == [], (sp, ids, r)
    # top_k past the vocabulary (up to int64) is the whole vocabulary, not an error.
    whole = eng.generate(PROMPTS["good"], sampled)[0]["token_ids"]
    for top_k in (2**63 - 1, 10**9):
        assert eng.generate(PROMPTS["good"], {**sampled, "top_k": top_k})[0]["token_ids"] == whole
    assert eng.generate(PROMPTS["good"], GREEDY)[0]["token_ids"] == refs["good"]
    assert_whole(eng)


def test_a_fatal_fault_still_ends_the_scheduler(engine, monkeypatch) -> None:
    """An assertion (a broken invariant: the pools may be inconsistent) is not contained."""
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    eng = engine(max_total_tokens=4096, max_running_requests=2, disable_overlap_schedule=True)
    sched = eng.scheduler
    forward = sched.worker.forward_batch_generation

    def broken(mwb, *args, **kw):
        if any(p.seed == BAD_SEED for p in mwb.sampling_params):
            raise AssertionError("injected broken invariant")
        return forward(mwb, *args, **kw)

    monkeypatch.setattr(sched.worker, "forward_batch_generation", broken)
    with pytest.raises(RuntimeError, match="injected broken invariant"):
        eng.generate(PROMPTS["bad"], {**GREEDY, "seed": BAD_SEED})
    eng.shutdown()  # the scheduler is gone on purpose: nothing whole to check


def test_which_faults_are_contained() -> None:
    import torch

    from tandem.engine.scheduler.batch_failure import is_fatal
    from tandem.engine.scheduler.cache_manager import OutOfKV

    contained = [ValueError("x"), TypeError("x"), IndexError("x"), RuntimeError("Overflow when unpacking long long")]
    fatal = [AssertionError("pool"), MemoryError(), OutOfKV("budget"), torch.OutOfMemoryError("oom"),
             RuntimeError("CUDA error: an illegal memory access was encountered"), KeyboardInterrupt()]
    assert not any(is_fatal(e) for e in contained) and all(is_fatal(e) for e in fatal)


def test_an_engine_built_under_inference_mode_serves(model_path) -> None:
    """Built inside the caller's torch.inference_mode() (as a benchmark's main() may be), the
    pools are inference tensors; the scheduler thread wrote them outside inference mode, which
    torch refuses: every prefill failed, and a flush then found a leaked request row."""
    import torch

    with torch.inference_mode():
        eng = Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=2048)
    try:
        with torch.inference_mode():
            first = eng.generate([PROMPTS["good"], PROMPTS["bad"]], GREEDY)
        assert all(r["finish_reason"] == "length" for r in first), first
        assert_whole(eng)  # flushes: the prompts run again uncached
        assert eng.generate(PROMPTS["good"], GREEDY)[0]["token_ids"] == first[0]["token_ids"]
        assert_whole(eng)
    finally:
        eng.shutdown()
