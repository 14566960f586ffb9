"""Contract tests of the prefix-cache seam, run against RadixCache (alone and over a host tier,
kvcache/host_tier.py) and NoPrefixCache.

Each test runs on both implementations (x page sizes 1 and 16) and expects the
same except where the contract lets them differ: the radix cache hits (`env.n`),
the no-op cache misses, keeps nothing and evicts nothing. `Env.check` is the leak
check: allocator pages in use == cached pages + pages held by running requests.
"""


from __future__ import annotations

import pytest
import torch
from prefix_cache_support import (
    Env,
    admit,
    extend,
    finish,
    insert_owned,
    make_env,
    seq,
)

from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.prefix_cache import NoPrefixCache
from tandem.engine.kvcache.radix_cache import RadixCache, create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool


def test_match_empty_partial_full_and_miss(env: Env) -> None:
    P = env.page
    for key in ([], seq(env, 1, 2)):  # empty cache
        match = env.cache.match_prefix(key)
        assert match.indices.numel() == 0 and match.indices.dtype == torch.int64
        env.cache.inc_lock_ref(match.last_node)  # locking an empty match is allowed
        env.cache.dec_lock_ref(match.last_node)
    _, slots = insert_owned(env, seq(env, 1, 2, 3))
    want = slots[: env.n(3 * P)]
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 2, 3)).indices, want)
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 2)).indices, want[: 2 * P])
    # Extra tokens past the cached key, whole or partial page, do not extend the match.
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 2, 3) + [7]).indices, want)
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 9)).indices, want[:P])
    assert env.cache.match_prefix(seq(env, 9)).indices.numel() == 0
    env.check()


@pytest.fixture(params=["radix", "tiered", "none"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def env(kind: str, request: pytest.FixtureRequest) -> Env:
    return make_env(kind, request.param)


def test_split_only_at_page_boundaries(env: Env) -> None:
    P = env.page
    _, slots = insert_owned(env, seq(env, 1, 2, 3))
    # Diverges at the last token of page 3 (P=16) or at page 3's start (P=1): page 3 cannot match.
    fork = seq(env, 1, 2) + seq(env, 3)[: P - 1] + [99]
    assert torch.equal(env.cache.match_prefix(fork).indices, slots[: env.n(2 * P)])
    assert env.cache.total_size() == env.n(3 * P), "a split must not change what is cached"
    env.check()
    cached, fork_slots = insert_owned(env, fork)
    assert cached == env.n(2 * P)
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 2, 3)).indices, slots[: env.n(3 * P)])
    fork_hit = torch.cat([slots[: 2 * P], fork_slots[2 * P :]])
    assert torch.equal(env.cache.match_prefix(fork).indices, fork_hit[: env.n(3 * P)])
    env.check()


def test_insert_returns_already_cached_length(env: Env) -> None:
    P = env.page
    for pages, already in [((1, 2, 3), 0), ((1, 2, 4), 2 * P), ((1, 2, 3), 3 * P), ((1,), P), ((5,), 0)]:
        assert insert_owned(env, seq(env, *pages))[0] == env.n(already)
        env.check()
    assert env.cache.total_size() == env.n(5 * P)  # pages 1 2 3 4 5
    with pytest.raises(ValueError):
        env.cache.insert(seq(env, 1), torch.arange(P + 1))  # one slot per token
    if P > 1:
        with pytest.raises(ValueError):
            env.cache.insert(seq(env, 1)[:-1], torch.arange(P - 1))  # not page-aligned


# ---- locking and eviction -------------------------------------------------------------
def test_locked_nodes_survive_eviction(env: Env) -> None:
    P = env.page
    _, slots = insert_owned(env, seq(env, 1, 2))
    insert_owned(env, seq(env, 3))
    node = env.cache.match_prefix(seq(env, 1, 2)).last_node
    env.cache.inc_lock_ref(node)
    env.cache.inc_lock_ref(node)
    assert (env.cache.protected_size(), env.cache.evictable_size()) == (env.n(2 * P), env.n(P))
    assert env.cache.evict(10**6) == env.n(P)
    env.cache.dec_lock_ref(node)
    assert env.cache.evict(10**6) == 0, "still locked once"
    assert torch.equal(env.cache.match_prefix(seq(env, 1, 2)).indices, slots[: env.n(2 * P)])
    env.cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        env.cache.dec_lock_ref(node)  # more unlocks than locks
    assert (env.cache.protected_size(), env.cache.evictable_size()) == (0, env.n(2 * P))
    assert env.cache.evict(1) == env.n(2 * P), "a node is evicted whole"
    if env.hits:  # the node's slots were freed: locking the old handle must fail loudly
        with pytest.raises(RuntimeError):
            env.cache.inc_lock_ref(node)
    assert env.cache.total_size() == 0
    env.check()


def test_eviction_is_lru_and_parents_follow_children(env: Env) -> None:
    P = env.page
    insert_owned(env, seq(env, 1, 2, 3))  # [1 2 3]
    insert_owned(env, seq(env, 1, 2, 4))  # [1 2] -> [3], [4]
    insert_owned(env, seq(env, 9))
    env.cache.match_prefix(seq(env, 1, 2, 3))  # [3] is now the newest leaf
    assert env.cache.evict(1) == env.n(P)  # [4], the oldest leaf
    assert len(env.cache.match_prefix(seq(env, 1, 2, 4)).indices) == env.n(2 * P)
    assert env.cache.evict(1) == env.n(P)  # [9]
    assert env.cache.match_prefix(seq(env, 9)).indices.numel() == 0
    assert env.cache.evict(1) == env.n(P)  # [3], though [1 2] was touched later: it is no leaf
    assert len(env.cache.match_prefix(seq(env, 1, 2, 3)).indices) == env.n(2 * P)
    assert env.cache.evict(1) == env.n(2 * P)  # [1 2], a leaf once its children went
    assert env.cache.total_size() == 0 and env.cache.evict(1) == 0
    env.check()


def test_reset_requires_no_locks_and_frees_everything(env: Env) -> None:
    insert_owned(env, seq(env, 1, 2))
    insert_owned(env, seq(env, 1, 3))
    node = env.cache.match_prefix(seq(env, 1, 2)).last_node
    env.cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        env.cache.reset()
    env.cache.dec_lock_ref(node)
    env.cache.reset()
    assert env.alloc.used_pages == 0 and env.cache.total_size() == 0
    assert env.cache.match_prefix(seq(env, 1, 2)).indices.numel() == 0
    env.check()


# ---- request lifecycle ------------------------------------------------------------------
def test_chunked_request_lifecycle(env: Env) -> None:
    P = env.page
    prompt = list(range(100, 100 + 3 * P + P // 2 + 1))  # P=16: 57 tokens; P=1: 4
    req = admit(env, prompt, kv_len=2 * P + P // 2 + 1)  # first prefill chunk, unaligned for P=16
    env.check()
    env.cache.cache_unfinished_req(req)
    assert len(req.prefix_indices) == env.n(2 * P + (P // 2 + 1) // P * P)
    env.check()
    assert extend(env, req, len(prompt) - req.kv_len)  # last chunk
    env.cache.cache_unfinished_req(req)
    assert extend(env, req, 2 * P, new_tokens=list(range(5000, 5000 + 2 * P)))  # decode
    env.check()
    aligned = req.kv_len - req.kv_len % P
    finish(env, req)
    assert env.cache.total_size() == env.n(aligned)
    env.check()
    # The same prompt again hits its cached pages, capped at len - 1 tokens.
    again = admit(env, prompt, kv_len=len(prompt))
    assert len(again.prefix_indices) == env.n((len(prompt) - 1) // P * P)
    finish(env, again)
    env.check()
    env.cache.reset()
    env.pool.reclaim()  # no forward is running: held rows are reusable
    assert env.alloc.used_pages == 0 and env.pool.available_size() == env.pool.size
    env.check()


@pytest.mark.parametrize("second", ["finished", "unfinished"])
def test_same_prompt_twice_frees_duplicates(env: Env, second: str) -> None:
    P = env.page
    prompt = list(range(200, 200 + 3 * P + 1))
    a = admit(env, prompt, kv_len=len(prompt))
    b = admit(env, prompt, kv_len=len(prompt))  # both missed: b holds its own copy of the KV
    assert len(b.prefix_indices) == 0
    finish(env, a)
    if second == "unfinished":
        env.cache.cache_unfinished_req(b)  # b's duplicate pages swap for the cached ones
        assert torch.equal(b.prefix_indices, env.cache.match_prefix(prompt).indices)
        env.check()
    finish(env, b)
    assert env.cache.total_size() == env.n(len(prompt) // P * P)
    env.check()


# ---- implementation-specific odds and ends -------------------------------------------------
def test_factory_picks_implementation() -> None:
    alloc, pool = PageAllocator(8, 4, "cpu"), ReqToTokenPool(2, 16, "cpu")
    assert isinstance(create_prefix_cache(True, pool, alloc, 4), NoPrefixCache)
    assert isinstance(create_prefix_cache(False, pool, alloc, 4), RadixCache)
    with pytest.raises(ValueError):
        create_prefix_cache(False, pool, alloc, 8)  # page size must be the allocator's


def test_radix_integrity_check_catches_corruption() -> None:
    env = make_env("radix", 4)
    insert_owned(env, seq(env, 1, 2))
    insert_owned(env, seq(env, 1, 3))
    env.check()
    cache = env.cache
    assert isinstance(cache, RadixCache)
    cache._evictable += 4
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._evictable -= 4
    leaf = cache.match_prefix(seq(env, 1, 3)).last_node
    leaf.slots = cache.match_prefix(seq(env, 1)).indices.clone()  # a slot cached twice
    with pytest.raises(AssertionError):
        cache.check_integrity()


# ---- randomized property test ---------------------------------------------------------
