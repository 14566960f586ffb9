"""The host tier under the radix cache (kvcache/host_tier.py, radix_cache.py): what the device
evicts is written to host pages and comes back, byte for byte, when a match reaches it; the
host tier drops its own least recent pages when full; both pools stay whole. The engine-level
checks (greedy tokens equal with and without the tier, pages evicted and loaded mid-run) are
in test_host_tier_engine.py."""

from __future__ import annotations

import random

import pytest
import torch
from prefix_cache_support import Env, finish, insert_owned, make_env, random_step, seq

from tandem.engine.kvcache.host_tier import HostTier, host_tokens


def _fill(env: Env, slots: torch.Tensor, value: float) -> None:
    """Give these device slots' K and V a recognisable value in every layer."""
    kv = env.cache.host.device_pool.kv_buffer  # type: ignore[union-attr]
    kv[:, :, slots] = value + torch.arange(slots.numel(), dtype=kv.dtype)[:, None, None]


def _kv(env: Env, slots: torch.Tensor) -> torch.Tensor:
    env.cache.settle()  # the queued copies land (a forward would wait for them layer by layer)
    return env.cache.host.device_pool.kv_buffer[:, :, slots].clone()  # type: ignore[union-attr]


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def tiered(request: pytest.FixtureRequest) -> Env:
    return make_env("tiered", request.param, num_pages=16, host_pages=8)


def test_an_evicted_prefix_comes_back_byte_for_byte(tiered: Env) -> None:
    env, P = tiered, tiered.page
    key = seq(env, 1, 2, 3)
    _, slots = insert_owned(env, key)
    _fill(env, slots, 100.0)
    want = _kv(env, slots)
    assert env.cache.evict(3 * P) == 3 * P  # written back (write_back policy), then freed
    assert env.cache.match_prefix(key).indices.numel() == 0 and env.cache.host_size() == 3 * P
    env.check()  # settles: the write to the host has run
    env.cache.host.device_pool.kv_buffer.zero_()  # type: ignore[union-attr]  # the freed pages are reused
    match = env.cache.match_and_load(key + [7])
    assert match.indices.numel() == 3 * P and match.host_hit == 3 * P
    assert torch.equal(_kv(env, match.indices), want)
    assert torch.equal(env.cache.match_prefix(key).indices, match.indices)  # on the device again
    stats = env.cache.host.stats  # type: ignore[union-attr]
    assert (stats.written_tokens, stats.loaded_tokens) == (3 * P, 3 * P)
    env.check()


def test_a_partly_evicted_path_loads_only_its_host_part(tiered: Env) -> None:
    env, P = tiered, tiered.page
    insert_owned(env, seq(env, 1, 2))
    insert_owned(env, seq(env, 1, 2, 3, 4))  # [1 2] then [3 4] below it
    env.cache.evict(2 * P)  # the leaf [3 4] goes to the host; [1 2] stays
    match = env.cache.match_and_load(seq(env, 1, 2, 3, 4, 5))
    assert match.indices.numel() == 4 * P and match.host_hit == 2 * P
    env.check()


def test_loading_never_evicts_the_prefix_it_extends(tiered: Env) -> None:
    """The device is full of the request's own prefix and other entries: making room for the
    host part evicts the others, never the matched prefix."""
    env, P = tiered, tiered.page
    insert_owned(env, seq(env, 1))
    insert_owned(env, seq(env, 1, 2))
    env.cache.evict(P)  # [2] to the host
    others = [insert_owned(env, seq(env, 10 + i))[1] for i in range(env.alloc.available_size() // P)]
    assert env.alloc.available_size() == 0 and len(others) > 0
    before = env.cache.match_prefix(seq(env, 1)).indices
    match = env.cache.match_and_load(seq(env, 1, 2, 9))
    assert match.indices.numel() == 2 * P and torch.equal(match.indices[:P], before)
    env.check()


def test_a_full_host_drops_its_least_recent_pages(tiered: Env) -> None:
    env, P = tiered, tiered.page
    host = env.cache.host
    for i in range(12):  # 12 single-page entries through an 8-page host tier
        insert_owned(env, seq(env, 20 + i))
        env.cache.evict(P)
    assert env.cache.host_size() == 8 * P and host.stats.dropped_tokens == 4 * P  # type: ignore[union-attr]
    assert env.cache.match_and_load(seq(env, 20, 0)).indices.numel() == 0  # the oldest are gone
    assert env.cache.match_and_load(seq(env, 31, 0)).host_hit == P  # the newest is there
    env.check()


def test_a_prefix_recomputed_anyway_takes_the_requests_pages(tiered: Env) -> None:
    """A request that matched before its prefix moved to the host computed it itself; caching
    it puts its pages under the host-only nodes instead of freeing them as duplicates."""
    env, P = tiered, tiered.page
    insert_owned(env, seq(env, 1, 2))
    env.cache.evict(2 * P)
    cached, slots = insert_owned(env, seq(env, 1, 2, 3))
    assert cached == 0  # nothing on the device: every page is the cache's now
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 2, 3)).indices, slots)
    assert env.cache.host_size() == 2 * P  # the host copies stay
    env.check()


def test_write_through_copies_once_when_the_cache_takes_a_page() -> None:
    env = make_env("tiered", 4, num_pages=16, host_pages=8)
    env.cache.host.write_through = True  # type: ignore[union-attr]
    insert_owned(env, seq(env, 1, 2))
    assert env.cache.host_size() == 8 and env.cache.host.stats.written_tokens == 8  # type: ignore[union-attr]
    env.cache.evict(8)  # already on the host: freed without a second copy
    assert env.cache.host.stats.written_tokens == 8  # type: ignore[union-attr]
    assert env.cache.match_and_load(seq(env, 1, 2, 3)).host_hit == 8
    env.check()


def test_reset_empties_both_tiers(tiered: Env) -> None:
    env, P = tiered, tiered.page
    insert_owned(env, seq(env, 1, 2))
    insert_owned(env, seq(env, 3))
    env.cache.evict(P)
    env.cache.reset()
    assert env.cache.total_size() == 0 and env.cache.host_size() == 0
    env.check()


def test_random_traffic_keeps_both_pools_whole() -> None:
    """Requests over shared prefixes, admitted, finished, evicted and loaded back at random on a
    small device pool and a smaller host tier; after every step both pools are whole, and a
    request's locked prefix is never taken."""
    rng = random.Random(7)
    env = make_env("tiered", 2, num_pages=24, host_pages=10)
    for _ in range(300):
        random_step(env, rng)
        env.check()
    while env.running:
        finish(env, env.running[0])
    env.check()


def test_the_size_is_gib_when_set_else_a_ratio_of_the_device_pool() -> None:
    from tandem.engine.kvcache.memory_pool import TokenToKVPool

    kv = TokenToKVPool(33, 16, 2, 2, 64, torch.bfloat16, "cpu")  # 512 tokens of 1 KiB
    assert kv.bytes_per_token() == 2 * 2 * 2 * 64 * 2
    assert host_tokens(kv, 2.0, 0) == 1024
    assert host_tokens(kv, 2.0, 1 / 1024) == 1024  # 1 MiB of 1 KiB tokens
    with pytest.raises(ValueError, match="write policy|hicache_write_policy"):
        HostTier(kv, 64, "write_through_selective")
    with pytest.raises(ValueError, match="at least one page"):
        HostTier(kv, 8, "write_back")
