"""CacheManager: owns KV pages, request rows and the prefix cache.

It is the one owner of request rows: it allocates a row when a request is first
admitted and frees it when the request stops holding KV.

The scheduler never touches the allocator or the tree directly; it asks this
manager for slots and hands back requests that stop running. Allocation evicts
unlocked prefix-cache leaves first when the free list is short.

Under overlap, what a batch's results free is held until reclaim() (holding()): batch N,
launched before N-1's results are processed, may still write the pages of a request that
N-1 finishes, and a page handed out meanwhile could take a KV transfer's write (NIXL is not
ordered with the forward) under N's. Freed pages wait in the allocator; the cached path of
a request released then stays locked, since eviction frees at once. The scheduler reclaims
when nothing launched before those frees still runs.

Row layout of a running request (positions of its req_to_token row):

    [0, len(prefix_indices))            owned by the prefix cache, locked via last_node
    [len(prefix_indices), committed)    owned by the request; freed or cached on release
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.scheduler.req import Req


class OutOfKV(RuntimeError):
    """The pool cannot hold what the scheduler promised; a budget bug, not a load condition."""


class CacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, tree_cache: object,
                 hold_freed: bool = False) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.allocator = kv_pool.allocator
        self.tree = tree_cache
        self.page_size = kv_pool.page_size
        self.hold_freed = hold_freed  # overlap: holding() holds; off, it does nothing
        self._holding = False
        self._held_nodes: list[object] = []  # cached paths locked until reclaim()

    # ---- capacity ------------------------------------------------------------------------
    @property
    def req_to_token(self) -> torch.Tensor:
        """The request rows as the host reads them (the pool's mirror off the CPU): no sync."""
        return self.req_to_token_pool.host

    def available_tokens(self) -> int:
        """Free now plus reclaimable by evicting unlocked cache entries."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def capacity_tokens(self) -> int:
        return self.kv_pool.capacity_tokens

    def free_rows(self) -> int:
        """Request rows a new request can take now; held rows are not among them."""
        return self.req_to_token_pool.available_size()

    def usage(self) -> float:
        used = self.capacity_tokens() - self.allocator.available_size() - self.tree.evictable_size()
        return used / self.capacity_tokens()

    def _ensure_free(self, pages: int) -> None:
        short = pages * self.page_size - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        if self.allocator.available_size() < pages * self.page_size:
            raise OutOfKV(f"need {pages} pages, {self.allocator.available_size() // self.page_size} free")

    # ---- allocation ------------------------------------------------------------------------
    def alloc_extend(self, reqs: list[Req]) -> torch.Tensor:
        """Give each request a row (if new) and slots for its extend tokens; returns the
        slots concatenated in request order and writes them into the rows."""
        prefix = [r.prefix_len for r in reqs]  # before rows are assigned: cache hits
        rows_needed = [r for r in reqs if r.req_pool_idx is None]
        if rows_needed:
            rows = self.req_to_token_pool.alloc(len(rows_needed))
            if rows is None:
                raise OutOfKV("out of request slots")
            # Every row is owned before any is written: if a write fails, the batch's failure
            # path (batch_faults) frees the rows its requests hold, and no row is orphaned.
            for r, row in zip(rows_needed, rows):
                r.req_pool_idx = row
            for r in rows_needed:  # a fresh row starts with the cached prefix the tree lent us
                self.req_to_token_pool.write(r.req_pool_idx, 0, r.prefix_indices)
        extend = [r.extend_input_len for r in reqs]
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([max(p - 1, 0) for p in prefix], dtype=torch.int64)
        last = self.req_to_token[rows, cols].tolist()
        self._ensure_free(sum(self.allocator.pages_needed(p, e) for p, e in zip(prefix, extend)))
        slots = self.allocator.alloc_extend(prefix, extend, last)
        assert slots is not None  # invariant: _ensure_free made room or raised
        start = 0
        try:
            for r, p, e in zip(reqs, prefix, extend):
                self.req_to_token_pool.write(r.req_pool_idx, p, slots[start : start + e])
                r.kv_committed_len = p + e
                start += e
        except Exception:
            # Slots no row records yet would be lost to the failure path, which frees what
            # each request's row holds up to its committed length: free them here.
            self.allocator.free(slots[start:])
            raise
        return slots

    def pages_needed(self, prefix: int, extend: int) -> int:
        """New pages a row holding `prefix` tokens takes to hold `extend` more."""
        return self.allocator.pages_needed(prefix, extend)

    def decode_pages_needed(self, reqs: list[Req]) -> int:
        return sum(self.allocator.pages_needed(r.kv_committed_len, 1) for r in reqs)

    def alloc_decode(self, reqs: list[Req]) -> np.ndarray:
        """One slot per request, for the position after its committed KV (int64)."""
        self._ensure_free(self.decode_pages_needed(reqs))
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        cols = np.fromiter((r.kv_committed_len for r in reqs), dtype=np.int64, count=len(reqs))
        slots = self.allocator.alloc_decode(cols + 1, self.req_to_token_pool.host_np[rows, cols - 1])
        if slots is None:  # _ensure_free made room: only a corrupted allocator gets here
            raise OutOfKV(f"no slots for {len(reqs)} decode tokens after making room")
        self.req_to_token_pool.write_decode_cells(rows, cols, slots)
        for r in reqs:
            r.kv_committed_len += 1
        return slots

    def alloc_staging(self, pages: int) -> list[int] | None:
        """Whole pages outside any request, evicting cache entries if need be: a PD role's
        staging for head slices (prefill/staging.py). None when the pool has no room now."""
        if pages * self.page_size > self.available_tokens():
            return None
        self._ensure_free(pages)
        got = self.allocator.alloc_pages(pages)
        if got is not None:
            self.settle_copies()  # staging is written outside a forward: no queued copy may still read it
        return None if got is None else got.tolist()

    def free_staging(self, pages: list[int]) -> None:
        """Pages alloc_staging gave out (the allocator frees a page by any of its slots: the first)."""
        self.allocator.free(torch.tensor(pages, dtype=torch.int64) * self.page_size)

    # ---- release --------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """The request stops holding KV (finished, aborted or retracted): its KV goes to
        the prefix cache (or is freed) and its row is returned."""
        if req.req_pool_idx is None:  # never admitted: it holds no KV and no lock
            return
        self._drop_unknown_tail(req)
        kv_ids = req.kv_token_ids() if self._holding else None
        self.tree.cache_finished_req(req)
        if kv_ids is not None:
            self._hold_cached(kv_ids)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_committed_len = 0
        req.last_node = None

    def discard(self, req: Req) -> None:
        """The request stops holding KV that must not be cached (pages reserved for a KV
        transfer that never completed): its own pages are freed, its prefix unlocked."""
        if req.req_pool_idx is None:
            return
        prefix = len(req.prefix_indices)  # page-aligned: the rest of the row is whole pages
        self.allocator.free(self.req_to_token[req.req_pool_idx, prefix : req.kv_committed_len].to(torch.int64))
        self.tree.dec_lock_ref(req.last_node)
        # A failed decode step may never have written its cells on the device (the forward writes
        # them: ModelRunner.write_decode_cells); the mirror's row is the truth.
        self.req_to_token_pool.sync_rows([req.req_pool_idx])
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_committed_len = 0
        req.last_node = None

    def _drop_unknown_tail(self, req: Req) -> None:
        """Under overlap a request can stop (abort) while a step that writes KV for a
        token it never received is in flight. Trim the row to the known tokens; pages
        wholly past them are freed here, a shared last page goes with the tail."""
        known = req.seqlen
        if req.kv_committed_len <= known:
            return
        P = self.page_size
        whole_from = -(-known // P) * P  # first position on a page holding no known token
        if req.kv_committed_len > whole_from:
            self.allocator.free(self.req_to_token[req.req_pool_idx, whole_from : req.kv_committed_len].to(torch.int64))
        req.kv_committed_len = known

    def cache_unfinished(self, req: Req) -> None:
        self.tree.cache_unfinished_req(req)

    def lock(self, node: object) -> None:
        self.tree.inc_lock_ref(node)

    def unlock(self, node: object) -> None:
        self.tree.dec_lock_ref(node)

    # ---- holding ------------------------------------------------------------------------------
    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold what is freed inside until reclaim() (see the module docstring)."""
        if not self.hold_freed:
            yield
            return
        self._holding = True
        self.allocator.hold_begin()
        try:
            yield
        finally:
            self.allocator.hold_end()
            self._holding = False

    def _hold_cached(self, kv_ids: list[int]) -> None:
        """Lock the cached path of a request just released: its last page may be one an
        in-flight batch writes, and evicting it would free that page at once."""
        aligned = len(kv_ids) - len(kv_ids) % self.page_size
        match = self.tree.match_prefix(kv_ids[:aligned])
        if match.indices.numel():
            self.tree.inc_lock_ref(match.last_node)
            self._held_nodes.append(match.last_node)

    def reclaim(self) -> None:
        """Every batch launched before the last frees has completed: held rows and pages
        become allocatable, held cached paths evictable."""
        self.req_to_token_pool.reclaim()
        self.allocator.reclaim()
        nodes, self._held_nodes = self._held_nodes, []
        for node in nodes:
            self.tree.dec_lock_ref(node)

    def settle_copies(self) -> None:
        """Finish the tiers' queued copies (prefix_cache.settle): pages about to go to
        something other than a forward may be ones an eviction is still writing to the host."""
        self.tree.settle()

    def flush(self) -> None:
        """Drop the prefix cache; only with nothing running or in flight."""
        self.reclaim()
        self.tree.reset()

    def free_group(self) -> _FreeGroup:
        return _FreeGroup(self.allocator)

    # ---- integrity ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """With no request running: every page in use belongs to the prefix cache, and
        nothing locks a cached prefix any more. Passing means the pool is whole. Called only
        with no batch in flight, so what is held can be reclaimed first."""
        self.reclaim()
        self.tree.check_integrity()
        assert self.tree.protected_size() == 0, f"{self.tree.protected_size()} cached tokens still locked"
        self.allocator.check_integrity(in_use_pages=self.tree.cached_pages())
        self.req_to_token_pool.check_integrity(in_use=0)


class _FreeGroup:
    """`with cache.free_group():` batches every free inside into one allocator call."""

    def __init__(self, allocator: object) -> None:
        self.allocator = allocator

    def __enter__(self) -> None:
        self.allocator.free_group_begin()  # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        self.allocator.free_group_end()  # type: ignore[attr-defined]
