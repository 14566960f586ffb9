"""Capacity is agreed, never asserted: a decode worker that can hold more requests than its
prefill has first-token slots (a larger --max-running-requests, or two decodes against one
prefill) sends a burst larger than prefill's slots. Prefill takes a slot when it accepts a
request's KVDest; one without a free slot waits in order for the next. Every request answers
with the tokens decode computes for it locally, prefill never exits, both pools whole."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from pd_client import pd_generate, pd_stats
from worker_process import Worker, running

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

FAST = ("--pd-heartbeat-interval", "0.5", "--pd-heartbeat-timeout", "5", "--max-total-tokens", "8192")
SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PREFILL_SLOTS = 2
BURST = 12  # six times prefill's slots


def test_a_burst_beyond_prefills_slots_waits_and_completes(model_path) -> None:
    model = model_path("tiny")
    pre = Worker.prefill(model, *FAST, "--max-running-requests", str(PREFILL_SLOTS))
    decs = [Worker.decode(model, *FAST, "--max-running-requests", "16", "--disable-radix-cache",
                    peers=[pre]) for _ in range(2)]
    prompts = [f"request {i} of a burst larger than the prefill worker's first-token slots " * 3
               for i in range(BURST)]
    with running(pre, *decs):
        with cf.ThreadPoolExecutor(BURST) as ex:
            got = list(ex.map(lambda i: pd_generate(pre, decs[i % 2], {"text": prompts[i], "sampling_params": SP}),
                              range(BURST)))
        assert pre.proc.poll() is None, pre.output()
        stats = pd_stats(pre)[0]
        assert stats["failed"] == 0 and stats["sends"] >= BURST, stats
        assert stats["slot_waits"] > 0, stats  # the burst did outrun the slots
        assert sum(pd_stats(d)[0]["transferred"] for d in decs) == BURST
        for w in (pre, *decs):
            assert w.pool()["whole"], w.output()
        # The same prompts prefilled on decode itself, from scratch (no radix cache there)
        local = [decs[i % 2].post("/generate", {"text": prompts[i], "sampling_params": SP}).json()
                 for i in range(BURST)]
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in local]
