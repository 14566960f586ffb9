"""Under overlap, KV pages freed while batch N-1's results are processed are handed out to
no allocation before batch N, launched earlier and maybe still writing them, has completed.

The decode role's race: a request finishes in N-1's results, N still writes its next-token
KV, and an arriving transfer's prealloc (decode/receiver.py) takes the freed (or cached,
then evicted) page for prefill to write over NIXL, which no stream orders after N. Hooks on
the scheduler thread make it deterministic: right after a result that finished a request
is processed, with a later batch in flight, a probe preallocates all the pool can give."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.req import Req


def prealloc_everything(cache: CacheManager) -> set[int]:
    """What the decode role does for an arriving transfer (DecodeReceiver._reserve), sized
    to take every page free or evictable now; returns the pages and gives them back."""
    P = cache.page_size
    probe = Req("probe", [5] * (cache.available_tokens() // P * P), SamplingParams(max_new_tokens=1))
    probe.init_next_round_input(cache.tree)
    cache.lock(probe.last_node)
    slots = cache.alloc_extend([probe])
    cache.discard(probe)
    return set((slots // P).tolist())


def request_pages(cache: CacheManager, req: Req) -> set[int]:
    row = cache.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
    return set((row // cache.page_size).tolist())


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_pages_freed_in_results_wait_for_the_batch_in_flight(engine, radix: bool, page_size: int) -> None:
    eng = engine(max_total_tokens=128, page_size=page_size, disable_overlap_schedule=False,
                 disable_radix_cache=not radix)
    sched = eng.scheduler
    assert sched.overlap is not None
    plain_launch, plain_process = sched.overlap.launch, sched.process_batch_result
    count = {"launched": 0, "processed": 0}
    clashes: list[set[int]] = []
    held: list[set[int]] = []  # pages checked above, until the next result is processed
    returned: list[bool] = []

    def launch(mwb):
        count["launched"] += 1
        return plain_launch(mwb)

    def process(batch, result) -> None:  # on the scheduler thread, in loop order
        count["processed"] += 1
        in_flight = count["launched"] > count["processed"]  # launched after this one, not processed
        owned = {r.rid: request_pages(sched.cache, r) for r in batch.reqs
                 if r.req_pool_idx is not None and not r.finished()}
        plain_process(batch, result)
        if held:  # the batch that was in flight has completed: the held pages are back
            returned.append(held.pop() <= prealloc_everything(sched.cache))
        freed = set().union(*(owned[r.rid] for r in batch.reqs if r.rid in owned and r.finished()))
        if freed and in_flight:
            clashes.append(freed & prealloc_everything(sched.cache))
            held.append(freed)

    sched.overlap.launch, sched.process_batch_result = launch, process
    sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (3, 9)]
    outs = eng.generate([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27]], sp)
    assert [len(o["token_ids"]) for o in outs] == [3, 9]
    eng.status()  # a round trip through the scheduler: the hook after the last output has run
    assert len(clashes) == 2, "each request finished with a later batch in flight"
    assert clashes == [set(), set()], f"pages handed out while a launched batch may write them: {clashes}"
    assert returned == [True, True], "held pages come back at the next result"
