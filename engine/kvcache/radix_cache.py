"""RadixCache: a page-granular radix tree of token prefixes -> KV slots.

Each node holds an edge: a run of tokens (`key`, a whole number of pages) and the
KV slots of those tokens (`slots`, one per token). A path from the root spells a
cached prefix; concatenating the slots along it gives that prefix's KV.

    root
    └── [p1 p2]            (children keyed by the first page: tuple(p1))
        ├── [p3]           an edge is split only at a page boundary, so the
        └── [p4 p5]        diverging page starts a new sibling

Children are found by the tuple of their first page's tokens, so matching costs
O(depth) dict lookups plus a compare of the matched tokens.

LRU: a logical clock ticks once per match/insert; every node on the touched path
takes the new tick, so a parent is never older than its children. evict() heaps
the unlocked leaves by (tick, node_id) and frees the oldest; a parent whose last
child goes becomes a leaf and joins the heap.

Locks: lock_ref counts requests whose matched path runs through a node (a lock
on a node increments it and every ancestor), so lock_ref >= sum of the children's.
Sizes are kept exactly: a node's tokens are protected while lock_ref > 0,
evictable otherwise.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import torch

from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.prefix_cache import CacheableReq, MatchResult, NoPrefixCache, PrefixCache
from tandem.engine.kvcache.req_table import ReqToTokenPool


class TreeNode:
    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access", "node_id")

    def __init__(self, key: list[int], slots: torch.Tensor, parent: TreeNode | None, node_id: int) -> None:
        self.key = key
        self.slots = slots  # (len(key),) int64
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent  # None for the root and for nodes that were evicted
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id  # creation order; breaks LRU ties (older first)


class RadixCache(PrefixCache):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool_allocator: PageAllocator, page_size: int
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool_allocator, page_size)
        self._clock = 0
        self._next_id = 0
        self._new_root()

    def _new_root(self) -> None:
        self.root = self._new_node([], torch.empty(0, dtype=torch.int64, device=self.device), None)
        self._evictable = 0
        self._protected = 0

    def _new_node(self, key: list[int], slots: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(key, slots, parent, self._next_id)

    # ---- lookup and insertion ------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        P = self.page_size
        key = list(token_ids[: len(token_ids) - len(token_ids) % P])
        tick = self._tick()
        node, pos, parts = self.root, 0, []
        while pos < len(key):
            child = node.children.get(tuple(key[pos : pos + P]))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)  # the diverging page cannot match below it
            child.last_access = tick
            parts.append(child.slots)
            node, pos = child, pos + n
        if not parts:
            return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device), self.root)
        return MatchResult(torch.cat(parts), node)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        P = self.page_size
        if len(token_ids) % P or slots.numel() != len(token_ids):
            raise ValueError("insert needs a page-aligned key with one slot per token")
        token_ids = list(token_ids)  # list slices compare equal below, tuples would not
        tick = self._tick()
        node, pos = self.root, 0
        while pos < len(token_ids):
            child = node.children.get(tuple(token_ids[pos : pos + P]))
            if child is None:
                leaf = self._new_node(list(token_ids[pos:]), slots[pos:].to(torch.int64, copy=True), node)
                leaf.last_access = tick
                node.children[tuple(leaf.key[:P])] = leaf
                self._evictable += len(leaf.key)
                return pos  # [0, pos) was already cached
            n = self._common_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, pos = child, pos + n
        return pos

    def _common_len(self, edge: list[int], key: list[int], pos: int) -> int:
        """Page-aligned length of the common prefix of `edge` and key[pos:]."""
        n = min(len(edge), len(key) - pos)
        if edge[:n] == key[pos : pos + n]:  # the common case, one C-level compare
            return n - n % self.page_size
        i = 0
        while i < n and edge[i] == key[pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node`'s edge after n tokens (n a page multiple); return the new upper half.

        The upper half takes node's place under the parent (same first page, same
        dict key) and inherits its lock count: every lock through node also runs
        through it, so sizes and lock consistency are unchanged."""
        P = self.page_size
        parent = node.parent
        # invariant: _split is called on a matched edge, inside it, at a page boundary
        assert parent is not None and 0 < n < len(node.key) and n % P == 0
        upper = self._new_node(node.key[:n], node.slots[:n].clone(), parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.key, node.slots = node.key[n:], node.slots[n:].clone()
        node.parent = upper
        upper.children[tuple(node.key[:P])] = node
        parent.children[tuple(upper.key[:P])] = upper
        return upper

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- locking ---------------------------------------------------------------------
    def inc_lock_ref(self, node: object) -> None:
        """Lock node's path. A handle whose node was evicted since the match raises:
        its slots were freed, so the caller must match again."""
        cur = self._check_attached(node)
        while cur is not self.root:
            if cur.lock_ref == 0:
                self._evictable -= len(cur.key)
                self._protected += len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent  # type: ignore[assignment]  # attached: parent is set up to root

    def dec_lock_ref(self, node: object) -> None:
        cur = self._check_attached(node)
        while cur is not self.root:
            if cur.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref without a matching inc_lock_ref")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._protected -= len(cur.key)
                self._evictable += len(cur.key)
            cur = cur.parent  # type: ignore[assignment]

    def _check_attached(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"not a RadixCache handle: {node!r}")
        if node is not self.root and node.parent is None:
            raise RuntimeError("handle refers to an evicted node; match again")
        return node

    # ---- request lifecycle ---------------------------------------------------------------
    def cache_finished_req(self, req: CacheableReq) -> None:
        """Row positions of a finished request, P = page_size:

            [0, prefix)          cache's, locked via last_node  -> unlock
            [prefix, cached)     req's duplicates of KV another request cached meanwhile -> free
            [cached, aligned)    req's, new to the cache        -> handed over by insert
            [aligned, kv_len)    req's partial last page        -> free
        prefix, cached and aligned are page multiples, so every freed range is whole pages."""
        token_ids = req.kv_token_ids()
        kv_len = len(token_ids)
        aligned = kv_len - kv_len % self.page_size
        prefix = len(req.prefix_indices)
        slots = self._row_slots(req, kv_len)
        cached = self.insert(token_ids[:aligned], slots[:aligned])
        # invariant: the request's lock keeps its prefix from eviction
        assert prefix <= cached, "the locked prefix must still be cached"
        self.allocator.free(torch.cat([slots[prefix:cached], slots[aligned:]]))
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Same split of the row as cache_finished_req, but the request keeps running:
        duplicates in [prefix, cached) are freed and the cache's slots written into
        the row in their place; [aligned, kv_len) stays the request's."""
        token_ids = req.kv_token_ids()
        aligned = len(token_ids) - len(token_ids) % self.page_size
        prefix = len(req.prefix_indices)
        slots = self._row_slots(req, aligned)
        cached = self.insert(token_ids[:aligned], slots)
        # invariant: the request's lock keeps its prefix from eviction
        assert prefix <= cached, "the locked prefix must still be cached"
        self.allocator.free(slots[prefix:cached])
        match = self.match_prefix(token_ids[:aligned])  # nothing evicts in between: a full hit
        assert match.indices.numel() == aligned  # invariant: just inserted, nothing evicts in between
        self.req_to_token_pool.write(req.req_pool_idx, prefix, match.indices[prefix:cached])
        # Lock the new path before unlocking the old so shared ancestors never drop to 0.
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    # ---- memory ----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # invariant: evict pops leaves, never the root
            del parent.children[tuple(leaf.key[: self.page_size])]
            leaf.parent = None  # marks the handle stale for inc_lock_ref
            freed.append(leaf.slots)
            num_freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked tokens")
        nodes = list(self._nodes())
        for node in nodes:
            node.parent = None  # stale every outstanding handle
        if nodes:
            self.allocator.free(torch.cat([n.slots for n in nodes]))
        self._new_root()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- integrity -------------------------------------------------------------------
    def check_integrity(self) -> None:
        P = self.page_size
        assert not self.root.key and self.root.parent is None and self.root.lock_ref == 0
        evictable = protected = 0
        all_slots = [self.root.slots]
        for node in self._nodes():
            n = len(node.key)
            assert n > 0 and n % P == 0, f"edge of {n} tokens is not whole pages"
            assert node.slots.numel() == n, f"edge of {n} tokens has {node.slots.numel()} slots"
            assert node.parent is not None and node.parent.children.get(tuple(node.key[:P])) is node, (
                "node is not under its parent by its first page"
            )
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks >= 0, f"lock_ref {node.lock_ref} < children's {child_locks}"
            assert node.last_access >= max((c.last_access for c in node.children.values()), default=0)
            if node.lock_ref:
                protected += n
            else:
                evictable += n
            all_slots.append(node.slots)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"tracked sizes {(self._evictable, self._protected)} != walked {(evictable, protected)}"
        )
        slots = torch.cat(all_slots).cpu()
        assert slots.numel() == torch.unique(slots).numel(), "a KV slot is cached twice"
        # Each page of an edge must be one whole allocator page: slots p*P .. p*P+P-1,
        # never page 0 (reserved). Freeing relies on it.
        pages = slots.view(-1, P)
        assert bool((pages[:, 0] % P == 0).all()) and bool((pages[:, 0] >= P).all()), "bad page start"
        assert bool((pages - pages[:, :1] == torch.arange(P)).all()), "a page's slots are not contiguous"


def create_prefix_cache(
    disable_radix_cache: bool,
    req_to_token_pool: ReqToTokenPool,
    kv_pool_allocator: PageAllocator,
    page_size: int,
) -> PrefixCache:
    """RadixCache unless the radix cache is disabled (here, beside the one module that knows both)."""
    if disable_radix_cache:
        return NoPrefixCache(req_to_token_pool, kv_pool_allocator, page_size)
    return RadixCache(req_to_token_pool, kv_pool_allocator, page_size)
