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

The lower tiers (a host pool, a disk directory) and the KV events are tiers.py's part of
this class.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

import torch

from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.disk_tier import DiskTier
from tandem.engine.kvcache.host_tier import HostTier
from tandem.engine.kvcache.kv_events import DEVICE, HOST, KVEventLog, block_hashes
from tandem.engine.kvcache.prefix_cache import CacheableReq, MatchResult, NoPrefixCache, PrefixCache
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.kvcache.tiers import LowerTiers


class TreeNode:
    __slots__ = ("key", "slots", "host", "hashes", "children", "parent", "lock_ref", "last_access", "node_id")

    def __init__(self, key: list[int], slots: torch.Tensor | None, parent: TreeNode | None, node_id: int) -> None:
        self.key = key
        self.slots = slots  # (len(key),) int64 device slots; None: on the host only
        self.host: torch.Tensor | None = None  # (len(key),) int64 host-tier slots, if it has a copy
        self.hashes: list[int] = []  # each page's chained hash, when KV events are on (kv_events.py)
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent  # None for the root and for nodes that were evicted
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id  # creation order; breaks LRU ties (older first)


class RadixCache(LowerTiers, PrefixCache):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool_allocator: PageAllocator, page_size: int,
        host: HostTier | None = None, events: KVEventLog | None = None, disk: DiskTier | None = None,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool_allocator, page_size)
        if disk is not None and host is None:
            raise ValueError("the disk tier sits under the host tier: it needs enable_hierarchical_cache")
        self.host = host
        self.events = events  # what is stored and removed, for an external router (kv_events.py)
        self.disk = disk  # pages the host drops, in files named by their block hash (disk_tier.py)
        # Under TP each rank has its own disk tier, whose writer lands a page in its own time: the
        # ranks take the smallest of what their disks hold, so that they load alike (tiers.py).
        self.agree = agree or (lambda n: n)
        self._hashing = events is not None or disk is not None  # both name a page by its block hash
        self._clock = 0
        self._next_id = 0
        self._loading: set[int] = set()  # node ids match_and_load is bringing back: not dropped meanwhile
        self._new_root()

    def _new_root(self) -> None:
        self.root = self._new_node([], torch.empty(0, dtype=torch.int64, device=self.device), None)
        self._evictable = 0
        self._protected = 0
        self._host_held = 0  # tokens with a host copy

    def _new_node(self, key: list[int], slots: torch.Tensor | None, parent: TreeNode | None) -> TreeNode:
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
            if child is None or child.slots is None:  # a host-only node: match_and_load's to bring back
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)  # the diverging page cannot match below it
            child.last_access = tick
            parts.append(child.slots)  # type: ignore[arg-type]  # a device node: slots set
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
        taken: int | None = None  # where the caller's slots began passing to host-only nodes
        while pos < len(token_ids):
            child = node.children.get(tuple(token_ids[pos : pos + P]))
            if child is None:
                leaf = self._new_node(list(token_ids[pos:]), slots[pos:].to(torch.int64, copy=True), node)
                leaf.last_access = tick
                node.children[tuple(leaf.key[:P])] = leaf
                self._evictable += len(leaf.key)
                if self._hashing:
                    leaf.hashes = block_hashes(self._parent_hash(leaf), leaf.key, P)
                    self._stored(leaf, DEVICE)
                if self.host is not None and self.host.write_through:
                    leaf.host = self._host_write(leaf)
                return pos if taken is None else taken  # [0, that) was already cached
            n = self._common_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            if child.slots is None:  # on the host only (so is all below it): the caller's KV is the device copy
                child.slots = slots[pos : pos + n].to(torch.int64, copy=True)
                self._evictable += n
                taken = pos if taken is None else taken
                self._stored(child, DEVICE)
            node, pos = child, pos + n
        return pos if taken is None else taken

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
        upper = self._new_node(node.key[:n], None if node.slots is None else node.slots[:n].clone(), parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        if node.host is not None:
            upper.host, node.host = node.host[:n].clone(), node.host[n:].clone()
        upper.hashes, node.hashes = node.hashes[: n // P], node.hashes[n // P :]
        node.key, node.slots = node.key[n:], None if node.slots is None else node.slots[n:].clone()
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
        if node is not self.root and (node.parent is None or node.slots is None):
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
        """Free device pages of unlocked leaves, least recent first. With a host tier a leaf
        moves to the host (written there first unless it has a copy) and stays matchable."""
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and leaf.slots is not None  # invariant: device leaves, never the root
            if self.host is not None and leaf.host is None:
                leaf.host = self._host_write(leaf)
            freed.append(leaf.slots)
            self._removed(leaf, DEVICE)
            if leaf.host is not None:
                leaf.slots = None  # on the host only now
            else:
                self._drop(leaf)
            num_freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    def _device_leaf(self, node: TreeNode) -> bool:
        return (node.slots is not None and node.lock_ref == 0
                and not any(c.slots is not None for c in node.children.values()))

    def _drop(self, node: TreeNode) -> None:
        """Take `node` and its subtree out of the tree, freeing their host pages; the caller
        frees its device pages (below it there are none: the device part is parent-closed)."""
        parent = node.parent
        assert parent is not None  # invariant: never the root
        del parent.children[tuple(node.key[: self.page_size])]
        stack = [node]
        while stack:
            n = stack.pop()
            self._spill(n)
            n.parent = None  # marks the handle stale for inc_lock_ref
            if n.host is not None:
                self._host_held -= n.host.numel()
                self.host.free(n.host)  # type: ignore[union-attr]  # a host copy implies a tier
                n.host = None
                self._removed(n, HOST)
            stack.extend(n.children.values())

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked tokens")
        self.settle()  # no queued copy may still read or write a page freed here
        nodes = list(self._nodes())
        for node in nodes:
            node.parent = None  # stale every outstanding handle
        on_device = [n.slots for n in nodes if n.slots is not None]
        if on_device:
            self.allocator.free(torch.cat(on_device))
        on_host = [n.host for n in nodes if n.host is not None]
        if on_host:
            self.host.free(torch.cat(on_host), dropped=False)  # type: ignore[union-attr]
        if self.events is not None:
            self.events.cleared()
        self._new_root()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def host_size(self) -> int:
        """Tokens with a copy in the host tier (0 without one)."""
        return self._host_held

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- integrity -------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.settle()  # run when idle: nothing should be left queued
        P = self.page_size
        assert not self.root.key and self.root.parent is None and self.root.lock_ref == 0
        evictable = protected = 0
        all_slots = [self.root.slots]
        host_slots: list[torch.Tensor] = []
        for node in self._nodes():
            n = len(node.key)
            assert n > 0 and n % P == 0, f"edge of {n} tokens is not whole pages"
            assert node.slots is not None or node.host is not None, "a node with its KV in neither tier"
            assert not self._hashing or len(node.hashes) == n // P, "a node's block hashes are not one a page"
            if node.host is not None:
                assert self.host is not None and node.host.numel() == n, "a host copy of the wrong length"
                host_slots.append(node.host)
            if node.slots is None:
                assert node.lock_ref == 0, "a lock on a node that is not on the device"
                assert all(c.slots is None for c in node.children.values()), "a device node under a host-only one"
                continue
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
        if self.host is not None:
            held = torch.cat(host_slots) if host_slots else torch.empty(0, dtype=torch.int64)
            assert held.numel() == self._host_held, f"host tokens tracked {self._host_held} != walked {held.numel()}"
            assert held.numel() == torch.unique(held).numel(), "a host slot is held twice"
            self.host.allocator.check_integrity(in_use_pages=held.numel() // P)
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
    host: HostTier | None = None,
    events: KVEventLog | None = None,
    disk: DiskTier | None = None,
    agree: Callable[[int], int] | None = None,
) -> PrefixCache:
    """RadixCache unless the radix cache is disabled (here, beside the one module that knows both)."""
    if disable_radix_cache:
        if host is not None or disk is not None:
            raise ValueError("the hierarchical cache is a tier of the radix cache: it needs the radix cache on")
        return NoPrefixCache(req_to_token_pool, kv_pool_allocator, page_size)
    return RadixCache(req_to_token_pool, kv_pool_allocator, page_size, host, events, disk, agree)
