"""Fakes and helpers shared by the prefix-cache contract tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.host_tier import HostTier
from tandem.engine.kvcache.kv_events import KVEventLog
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.prefix_cache import PrefixCache
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool


@dataclass(eq=False)
class FakeReq:
    tokens: list[int]
    kv_len: int  # positions [0, kv_len) of the row hold KV
    req_pool_idx: int
    prefix_indices: torch.Tensor
    last_node: object

    def kv_token_ids(self) -> list[int]:
        return self.tokens[: self.kv_len]


@dataclass
class Env:
    cache: PrefixCache
    alloc: PageAllocator
    pool: ReqToTokenPool
    page: int
    hits: bool
    running: list[FakeReq] = field(default_factory=list)

    def n(self, tokens: int) -> int:
        """What a `tokens`-long hit comes to in this implementation."""
        return tokens if self.hits else 0

    def row(self, req: FakeReq) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx, : req.kv_len].long()

    def check(self) -> None:
        # A running request owns the pages of its row past its cached prefix.
        held = [self.row(r)[len(r.prefix_indices) :] // self.page for r in self.running]
        held_pages = sum(int(torch.unique(h).numel()) for h in held)
        self.cache.check_integrity()
        self.alloc.check_integrity(in_use_pages=self.cache.cached_pages() + held_pages)
        self.pool.check_integrity(in_use=len(self.running))
        for r in self.running:
            prefix = r.prefix_indices
            assert torch.equal(self.row(r)[: len(prefix)], prefix), "row does not start with the prefix"
            # Locked prefixes are never evicted: they still match, slot for slot.
            assert torch.equal(self.cache.match_prefix(r.tokens[: len(prefix)]).indices, prefix)

    def take(self, prefix_len: int, extend_len: int, last_loc: int) -> torch.Tensor | None:
        """Slots for positions [prefix_len, prefix_len + extend_len), evicting first if short."""
        short = self.alloc.pages_needed(prefix_len, extend_len) * self.page - self.alloc.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.alloc.alloc_extend([prefix_len], [extend_len], [last_loc])


def make_env(kind: str, page_size: int, num_pages: int = 64, host_pages: int = 16, events: bool = False) -> Env:
    """kind: "radix", "none", or "tiered" (the radix cache over a host tier of `host_pages`,
    write-back, so eviction writes and a match can load); `events`: the cache logs KV events
    (cache.events, a KVEventLog)."""
    pool = ReqToTokenPool(8, 64 * page_size, "cpu")
    host = None
    if kind == "tiered":
        kv = TokenToKVPool(num_pages, page_size, 2, 1, 16, torch.float32, "cpu")
        alloc = kv.allocator
        host = HostTier(kv, host_pages * page_size, "write_back")
    else:
        alloc = PageAllocator(num_pages, page_size, "cpu")
    log = KVEventLog(page_size) if events else None
    cache = create_prefix_cache(kind == "none", pool, alloc, page_size, host, log)
    return Env(cache, alloc, pool, page_size, hits=kind != "none")


def seq(env: Env, *page_ids: int) -> list[int]:
    """Whole pages of distinct tokens: page id k -> tokens k*1000 .. k*1000+P-1."""
    return [k * 1000 + j for k in page_ids for j in range(env.page)]


def insert_owned(env: Env, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """Allocate slots for `tokens`, insert them, and free the duplicates as a caller must."""
    slots = env.alloc.alloc(len(tokens))
    cached = env.cache.insert(tokens, slots)
    env.alloc.free(slots[:cached])
    return cached, slots


def admit(env: Env, tokens: list[int], kv_len: int) -> FakeReq | None:
    """Scheduler admission: match (capped at len-1), lock, take a row, prefill [prefix, kv_len)."""
    match = env.cache.match_prefix(tokens[: len(tokens) - 1])
    env.cache.inc_lock_ref(match.last_node)
    prefix = len(match.indices)
    slots = env.take(prefix, kv_len - prefix, 0)
    if slots is None:
        env.cache.dec_lock_ref(match.last_node)
        return None
    (row,) = env.pool.alloc(1)
    env.pool.write(row, 0, torch.cat([match.indices, slots]))
    env.running.append(FakeReq(list(tokens), kv_len, row, match.indices, match.last_node))
    return env.running[-1]


def extend(env: Env, req: FakeReq, n: int, new_tokens: list[int] | None = None) -> bool:
    """Compute n more positions (rest of the prompt, then `new_tokens` as decoded output)."""
    slots = env.take(req.kv_len, n, int(env.pool.req_to_token[req.req_pool_idx, req.kv_len - 1]))
    if slots is None:
        return False
    req.tokens.extend((new_tokens or [])[: max(0, req.kv_len + n - len(req.tokens))])
    env.pool.write(req.req_pool_idx, req.kv_len, slots)
    req.kv_len += n
    return True


def finish(env: Env, req: FakeReq) -> None:
    env.cache.cache_finished_req(req)
    env.pool.free(req.req_pool_idx)  # the row's owner (the cache manager, in the engine) frees it
    env.running.remove(req)


# ---- matching and insertion ---------------------------------------------------------------


def random_step(env: Env, rng: random.Random, reset: bool = False) -> None:
    """One step of random traffic over four shared page prefixes: admit a request (its prefix
    matched and loaded from lower tiers, as admission does), finish one, evict, or with `reset`
    drop the whole cache when nothing runs."""
    op = rng.random()
    if op < 0.45 and len(env.running) < 6:
        prompt = seq(env, *[rng.randrange(4) for _ in range(rng.randrange(1, 5))]) + [rng.randrange(9)]
        env.cache.match_and_load(prompt[:-1])
        admit(env, prompt, len(prompt))
    elif op < 0.8 and env.running:
        finish(env, rng.choice(env.running))
        env.pool.reclaim()  # a freed row is held until the step that could use it is done
    elif op < 0.97 or not reset:
        env.cache.evict(rng.randrange(1, 8))
    elif not env.running:
        env.cache.reset()
