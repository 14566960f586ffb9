"""Reserving a room on decode (decode/prealloc.py) over a real cache: the prefix a request
matched counts as room while it is evictable, and stops counting once the room locks it. A room
that fits only by evicting its own prefix waits instead of raising OutOfKV (the host tier made
this common: a prefix it loads back is unlocked, evictable room until its room locks it; `tandem
up` in PD crashed a decode on it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kv_caches import cache_over

from tandem.decode.prealloc import reserve_room, room_needed
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.req import Req

P, PAGES = 4, 8  # page 0 is the allocator's: 7 pages of room


def _setup(new_tokens: int):  # type: ignore[no-untyped-def]
    pool = TokenToKVPool(num_pages=PAGES, page_size=P, num_layers=2, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device="cpu")
    cache = cache_over(pool)
    prefix = list(range(100, 120))  # 5 pages, cached and unlocked: evictable room
    slots = cache.allocator.alloc_pages(5)
    cache.tree.insert(prefix, (slots[:, None] * P + torch.arange(P)).flatten())
    req = Req("r", prefix + list(range(500, 500 + new_tokens)), SamplingParams(max_new_tokens=4))
    req.init_next_round_input(cache.tree)
    assert len(req.prefix_indices) == 20
    host = SimpleNamespace(cache=cache, config=SimpleNamespace(clip_max_new_tokens=4096), new_token_ratio=1.0,
                           kv_headroom=cache.available_tokens)
    slot_pool = SimpleNamespace(free=1, alloc=lambda: 0)
    staging = SimpleNamespace(pages_needed=lambda plan, pages: 0, reserve=lambda plan, n: [])
    inc = SimpleNamespace(req=req, slot=None, pages=None, staging=None)
    return cache, host, slot_pool, staging, inc


def test_a_room_that_fits_only_by_evicting_its_own_prefix_waits() -> None:
    """12 new tokens (3 pages) and 4 to decode: 28 tokens of headroom before the lock (2 pages
    free + the 5-page prefix), 8 after it. The room waits, holding nothing."""
    cache, host, slots, staging, inc = _setup(new_tokens=12)
    assert cache.available_tokens() == 28
    assert reserve_room(host, slots, staging, None, inc, room_needed(host, staging, None, inc)) is False  # type: ignore[arg-type]
    assert cache.tree.protected_size() == 0 and inc.pages is None  # the lock was given back
    assert cache.allocator.available_size() == 8  # nothing taken, nothing evicted
    cache.check_integrity()


def test_a_room_that_fits_beside_its_locked_prefix_is_taken() -> None:
    """4 new tokens and 4 to decode: the 8 tokens free beside the locked prefix."""
    cache, host, slots, staging, inc = _setup(new_tokens=4)
    assert reserve_room(host, slots, staging, None, inc, room_needed(host, staging, None, inc)) is True  # type: ignore[arg-type]
    assert len(inc.pages) == 1 and cache.tree.protected_size() == 20
    cache.unlock(inc.req.last_node)


def test_a_prompt_that_fills_the_pool_is_not_held_back_by_the_decode_estimate() -> None:
    """26 prompt tokens and 2 to decode fill the 7 pages exactly; the estimate (prompt pages plus
    max_new_tokens) came to 30 tokens, more than the pool, and the room waited for ever (until
    pd_prealloc_timeout): a PD test with a 256-token decode pool timed out on its first request."""
    pool = TokenToKVPool(num_pages=PAGES, page_size=P, num_layers=2, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device="cpu")
    cache = cache_over(pool)
    req = Req("r", list(range(100, 126)), SamplingParams(max_new_tokens=2))
    req.init_next_round_input(cache.tree)
    host = SimpleNamespace(cache=cache, config=SimpleNamespace(clip_max_new_tokens=4096), new_token_ratio=1.0,
                           kv_headroom=cache.available_tokens)
    inc = SimpleNamespace(req=req, slot=None, pages=None, staging=None)
    staging = SimpleNamespace(pages_needed=lambda plan, pages: 0, reserve=lambda plan, n: [])
    assert room_needed(host, staging, None, inc) == 28 == cache.capacity_tokens()  # type: ignore[arg-type]
    assert reserve_room(host, SimpleNamespace(free=1, alloc=lambda: 0), staging, None, inc, 28)  # type: ignore[arg-type]
    assert len(inc.pages) == 7
