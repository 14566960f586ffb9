"""Request rows never run out under the scheduler: admission takes only free rows (the prefill
adder stops at none, as it stops on its KV budget), and rows held for a batch whose forward
failed come back once nothing is in flight, so the scheduler lives on after a run of failing
batches (both loops)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_checks import submit_together

from tandem.engine.engine_config import EngineConfig
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.prefill_adder import AddReqResult, PrefillAdder
from tandem.engine.scheduler.prefill_manager import PrefillManager
from tandem.engine.scheduler.req import Req
from tandem.engine.scheduler.schedule_policy import SchedulePolicy

BAD_SEED = 4242  # the marker of requests whose forwards fail


def _prefill(rows: int) -> PrefillManager:
    table = ReqToTokenPool(rows, 64, "cpu")
    kv = TokenToKVPool(512 + 1, 1, 1, 1, 4, torch.float32, "cpu")
    cache = CacheManager(table, kv, create_prefix_cache(False, table, kv.allocator, 1))
    config = EngineConfig(device="cpu", max_running_requests=8, chunked_prefill_size=0)
    return PrefillManager(config, cache, SchedulePolicy("fcfs", cache.tree, False))


def test_prefill_admits_no_more_requests_than_free_rows() -> None:
    pm = _prefill(rows=3)
    table = pm.cache.req_to_token_pool
    for row in table.alloc(2):
        table.free(row)  # held, as after a batch in flight: not free until reclaimed
    for i in range(4):
        pm.add(Req(f"r{i}", list(range(10, 18)), SamplingParams(max_new_tokens=4)))
    batch, _ = pm.schedule_next_batch([], 0.5)
    assert batch is not None and [r.rid for r in batch.reqs] == ["r0"]

    batch, adder = pm.schedule_next_batch(batch.reqs, 0.5)  # no row free: none admitted, none lost
    assert batch is None and adder is not None and adder.budget_state() == AddReqResult.NO_ROW
    assert [r.rid for r in pm.waiting_queue] == ["r1", "r2", "r3"]
    assert PrefillAdder(pm.cache, [], 0.5, 1024, None, 64).add_one_req(pm.waiting_queue[0]) == AddReqResult.NO_ROW

    table.reclaim()
    batch, _ = pm.schedule_next_batch([], 0.5)
    assert batch is not None and [r.rid for r in batch.reqs] == ["r1", "r2"]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_failing_batches_do_not_use_up_the_rows(engine, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three batches in a row fail in their forward: each one's rows are held and no result
    reclaims them. The table has 2 x 4 rows, so the third admission found none and the
    scheduler died; now the rows come back and the requests after them run."""
    eng = engine(max_running_requests=4, max_total_tokens=4096, disable_overlap_schedule=not overlap)
    sched = eng.scheduler
    forward = sched.worker.forward_batch_generation

    def failing_forward(mwb: Any, *args: Any, **kw: Any) -> Any:  # on the forward thread under overlap
        if any(p.seed == BAD_SEED for p in mwb.sampling_params):
            raise ValueError("injected forward fault")
        return forward(mwb, *args, **kw)

    monkeypatch.setattr(sched.worker, "forward_batch_generation", failing_forward)
    bad = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True, "seed": BAD_SEED}
    lasts = [last for _, last in submit_together(eng, [([20 + i] * 16, bad) for i in range(12)])]
    assert [out.finish_reason["kind"] for out in lasts] == ["abort"] * 12

    outs = eng.generate([[30 + i] * 16 for i in range(4)], {"max_new_tokens": 8, "temperature": 0.0,
                                                              "ignore_eos": True})
    assert [len(o["token_ids"]) for o in outs] == [8] * 4
    assert eng.error is None
