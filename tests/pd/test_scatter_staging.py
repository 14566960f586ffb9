"""The decode side's staging of head slices (decode/staging.py): staging pages are reserved
from the pool beside the room's, what a prefill rank writes there as whole pages (seen at the
slice's width) lands in the heads of the room's slots after `scatter`, and every staging page
goes back. A room whose staging could never fit beside it goes as slices (no staging). Real
NIXL sends into staging: tests/pd/test_kv_transfer_tp.py (`staged`); through the PD roles:
test_pd_tensor_parallel.py (TP 2 -> 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_caches import cache_over

from tandem.decode.staging import ScatterStaging
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.page_copy import MAX_RUN_COPIES
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.pd.parts import Link
from tandem.pd.transfer.head_map import Staging, plan_writes, staging_of
from tandem.pd.transfer.pages import staged_pages
from tandem.protocol.kv_layout import shard_heads

LAYERS, PAGE, HEADS, DIM = 2, 4, 4, 8


def cache(pages: int, heads: tuple[int, int] = (0, HEADS)) -> CacheManager:
    pool = TokenToKVPool(num_pages=pages, page_size=PAGE, num_layers=LAYERS, num_kv_heads=heads[1] - heads[0],
                         head_dim=DIM, dtype=torch.bfloat16, device="cpu", heads=heads, total_kv_heads=HEADS)
    pool.kv_buffer.zero_()
    return cache_over(pool)


@pytest.mark.parametrize("room", [[3, 4, 5], [9, 2, 7, 8], [1], list(range(1, 2 * MAX_RUN_COPIES + 3, 2))],
                         ids=["one-run", "scattered", "one-page", "more-runs-than-copies"])
@pytest.mark.parametrize("tp_p", [2, 4])
def test_what_prefill_writes_into_staging_lands_in_the_rooms_heads(room: list[int], tp_p: int) -> None:
    c = cache(48)
    c.allocator.alloc_pages(20)  # the room's pages belong to its request
    mine = c.kv_pool.layout()
    prefill = [dataclasses.replace(mine, num_kv_heads=HEADS // tp_p, head_start=shard_heads(HEADS, tp_p, r)[0])
               for r in range(tp_p)]
    writes = plan_writes(prefill, [mine])
    plan = staging_of(writes, [mine])
    assert plan == Staging(tp_p, tp_p, 48)
    staging = ScatterStaging(c)
    free = c.allocator.available_size()
    lists = staging.reserve(plan, len(room))
    assert len(lists) == tp_p and free - c.allocator.available_size() == tp_p * -(-len(room) // tp_p) * PAGE
    want = torch.randn(LAYERS, 2, len(room), PAGE, HEADS, DIM).to(torch.bfloat16)
    for w in writes:  # what each prefill rank's NIXL write leaves in decode's staging pages
        lo, hi = w.heads
        view = c.kv_pool.kv_buffer.view(LAYERS, 2, 48 * plan.per_page, PAGE, hi - lo, DIM)
        view[:, :, staged_pages(lists[w.scatter], 0, len(room), plan.per_page)] = want[:, :, :, :, lo:hi]
    staging.scatter(Link(tuple(writes)), lists, room)
    got = c.kv_pool.kv_buffer.view(LAYERS, 2, 48, PAGE, HEADS, DIM)[:, :, room]
    assert torch.equal(got, want)
    staging.free(lists)
    assert c.allocator.available_size() == free and staging.stats["scattered_rooms"] == 1


def test_a_room_whose_staging_cannot_fit_goes_as_slices() -> None:
    c = cache(10)  # 9 usable pages
    staging, plan = ScatterStaging(c), Staging(writes=2, per_page=2, num_pages=10)
    assert staging.pages_needed(plan, 4) == 4  # 2 writes x 2 pool pages, beside the room's 4: fits
    assert staging.pages_needed(plan, 6) == 0  # 6 + 6 > 9: never
    assert staging.reserve(plan, 6) == [] and staging.stats["unstaged_rooms"] == 1
    assert staging.pages_needed(Staging(), 4) == 0 and staging.reserve(Staging(), 4) == []  # nothing to stage
    assert staging.stats["unstaged_rooms"] == 1
    c.allocator.alloc_pages(6)  # the pool falls short after all (a budget that counted too much)
    assert staging.reserve(plan, 4) == [] and staging.stats["unstaged_rooms"] == 2
    assert c.allocator.available_size() == 3 * PAGE  # nothing kept of a half-reserved room


def test_a_staging_list_that_is_not_what_decode_must_send_is_refused() -> None:
    plan = Staging(writes=2, per_page=2, num_pages=10)
    assert plan.problem([], 5) is None  # decode stages nothing: the slices go as they lie
    assert plan.problem([[1, 2, 3], [4, 5, 6]], 5) is None
    assert "2 lists of 3 pages" in plan.problem([[1, 2, 3]], 5)
    assert "2 lists of 3 pages" in plan.problem([[1, 2, 3], [4, 5]], 5)
    assert "outside 1..9" in plan.problem([[1, 2, 3], [4, 5, 10]], 5)
    assert "outside 1..9" in plan.problem([[0, 2, 3], [4, 5, 6]], 5)  # page 0: the pad page
    assert "0 lists" in Staging().problem([[1]], 1)  # staging where the plan has none
