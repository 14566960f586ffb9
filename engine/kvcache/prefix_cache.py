"""The prefix-cache seam: the contract, the no-op cache, and the factory.

Data flow around a request (the scheduler drives it; the cache owns KV pages
once they are inserted):

    admit   : match_prefix(ids[:input_len-1]) -> MatchResult; inc_lock_ref(last_node)
    prefill : caller allocates slots for [prefix_len, seq_len) in its req_to_token row
    chunk   : cache_unfinished_req(req)  -> aligned part handed to the cache, re-locked
    finish  : cache_finished_req(req)    -> everything handed over or freed (the caller frees the row)
    memory  : evict(n) frees unlocked LRU leaves; reset() drops the whole cache

Ownership rule: every KV page is owned by exactly one party, the cache or one
running request. `allocator.used_pages == cache.cached_pages() + pages held by
running requests` (+ pages freed but held until reclaim, allocator.py) is the leak
check built on it.

Two implementations share one contract test (tests/engine/test_prefix_cache.py):
RadixCache (radix_cache.py) and NoPrefixCache (below, caches nothing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.req_table import ReqToTokenPool


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a key."""

    indices: torch.Tensor  # (prefix_len,) int64 KV slots; prefix_len % page_size == 0
    last_node: object  # opaque handle: lock/unlock it, pass it back in req.last_node
    host_hit: int = 0  # of those, tokens match_and_load copied back from the host tier


class CacheableReq(Protocol):
    """What the cache needs from a request; anything with these attributes works."""

    req_pool_idx: int  # row of req_to_token
    prefix_indices: torch.Tensor  # slots of the matched prefix, owned by the cache
    last_node: object  # handle from the last match, currently locked by this request

    def kv_token_ids(self) -> list[int]:
        """Tokens whose KV sits in row `req_pool_idx`, positions [0, len)."""
        ...


class PrefixCache(ABC):
    """A cache of KV pages keyed by token prefixes, page-granular.

    All lengths are in tokens. A page holds `page_size` tokens, and every key the
    cache stores or returns is a whole number of pages.
    """

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool_allocator: PageAllocator, page_size: int
    ) -> None:
        if page_size < 1 or page_size != kv_pool_allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator's {kv_pool_allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.host.device  # slots live on the host (see ReqToTokenPool.host)

    # ---- lookup and insertion ------------------------------------------------------------
    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids`.

        Side effects: may split a node at a page boundary (what is cached does not
        change) and refreshes LRU times along the matched path. Never frees, evicts
        or locks. The caller caps the key (at most input_len - 1 tokens)."""

    def match_and_load(self, token_ids: list[int]) -> MatchResult:
        """match_prefix, for a request about to be admitted: a cache with a lower tier copies
        what it holds of the key back to the device first (so it may evict, never lock). The
        result's slots are on the device and unlocked, as match_prefix's."""
        return self.match_prefix(token_ids)

    def launch_copies(self) -> object | None:
        """Start the copies between tiers queued since the last launch (a batch is launching);
        what its forward waits on before each layer (`wait(layer)`), or None when nothing is in
        flight. A cache without lower tiers copies nothing."""
        return None

    def settle(self) -> None:
        """Finish every queued copy between tiers: afterwards the device pages are the caller's
        to hand to anything that is not a forward (a PD transfer writes a room's pages)."""
        return None

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Cache a page-aligned key with its KV slots; return the length already cached.

        Ownership of slots[ret:] passes to the cache (a cache that keeps nothing
        frees them at once). slots[:ret] stay the caller's: they duplicate cached
        KV and the caller must free them (or keep using them)."""

    # ---- locking ---------------------------------------------------------------------
    @abstractmethod
    def inc_lock_ref(self, node: object) -> None:
        """Lock the path from `node` to the root: none of it can be evicted."""

    @abstractmethod
    def dec_lock_ref(self, node: object) -> None:
        """Undo one inc_lock_ref(node). Raises on an unlock with no matching lock."""

    # ---- request lifecycle ---------------------------------------------------------------
    @abstractmethod
    def cache_finished_req(self, req: CacheableReq) -> None:
        """Retire a finished request: hand its aligned KV to the cache, free the rest
        (duplicates of cached KV, the unaligned tail) and unlock req.last_node. Afterwards
        the request owns no KV; its req_to_token row is the caller's to free (the row
        table has one owner, the cache manager)."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Checkpoint a running request (after a prefill chunk).

        Hands its aligned KV to the cache, swaps in the cache's slots where it held
        duplicates, and moves its lock to the new deepest node, updating
        req.prefix_indices and req.last_node. The unaligned tail stays the
        request's. Guarantee: req_to_token[row, :len(prefix_indices)] == prefix_indices."""

    # ---- memory ----------------------------------------------------------------------
    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of unlocked cached KV, least recently used
        first, or all that is evictable. Returns the tokens freed."""

    @abstractmethod
    def reset(self) -> None:
        """Drop and free everything cached. Raises if anything is locked."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens not locked by any request."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens locked by at least one request."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the cache's internal invariants (see each implementation)."""

    # ---- derived ---------------------------------------------------------------------
    def total_size(self) -> int:
        """All cached tokens."""
        return self.evictable_size() + self.protected_size()

    def cached_pages(self) -> int:
        """Pages owned by the cache (for the allocator's in_use_pages leak check)."""
        return self.total_size() // self.page_size

    def _row_slots(self, req: CacheableReq, end: int) -> torch.Tensor:
        """A copy of the request's slots for positions [0, end), as int64."""
        row = self.req_to_token_pool.host[req.req_pool_idx, :end]  # the host's copy: no sync
        return row.to(torch.int64, copy=True)


class NoPrefixCache(PrefixCache):
    """Caches nothing: every match misses and every finished request frees all its KV.

    Same contract as RadixCache so the scheduler never branches on the cache type.
    It still counts locks, so an unbalanced dec_lock_ref is caught here too."""

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool_allocator: PageAllocator, page_size: int
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool_allocator, page_size)
        self._root = object()  # the only handle this cache ever returns
        self._locks = 0

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device), self._root)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        if len(token_ids) % self.page_size or slots.numel() != len(token_ids):
            raise ValueError("insert needs a page-aligned key with one slot per token")
        self.allocator.free(slots)  # ownership passed to us; we keep nothing
        return 0

    def inc_lock_ref(self, node: object) -> None:
        self._check_handle(node)
        self._locks += 1

    def dec_lock_ref(self, node: object) -> None:
        self._check_handle(node)
        if self._locks == 0:
            raise RuntimeError("dec_lock_ref without a matching inc_lock_ref")
        self._locks -= 1

    def cache_finished_req(self, req: CacheableReq) -> None:
        # prefix_indices is always empty here, so the request owns its whole row span.
        kv_len = len(req.kv_token_ids())
        self.allocator.free(self._row_slots(req, kv_len))
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Nothing is handed over: the request keeps all its KV and its empty prefix."""

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        if self._locks:
            raise RuntimeError(f"reset with {self._locks} lock(s) held")

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def check_integrity(self) -> None:
        assert self._locks >= 0, f"negative lock count {self._locks}"

    def _check_handle(self, node: object) -> None:
        if node is not self._root:
            raise ValueError("handle was not returned by this cache's match_prefix")
