"""The radix cache's lower tiers and its KV events: the part of RadixCache (radix_cache.py, which
mixes this class in) that moves pages between the device pool, the host tier (host_tier.py) and
the disk tier (disk_tier.py), and tells an external router what it stored and removed
(kv_events.py). It uses the tree's own fields and helpers; it is a file of its own because the
rules between the tiers are a concept of their own.

With a host tier (`--enable-hierarchical-cache`) a node's KV may live on the device (`slots`),
on the host (`host`), or on both. The rules between the tiers:

- The device part of the tree is closed under parents: a node on the device has its parent
  there too, so a match's device prefix is one walk from the root, and a lock (which only a
  device node takes) covers device nodes only.
- Eviction takes a device leaf (no child on the device), unlocked, least recent first: its
  pages are written to the host unless it has a copy there (write_back; write_through copied
  them when the cache took them), then freed on the device. The node stays, on the host only.
  Where the host has no room even after dropping its own least recent leaves, the node goes
  with its subtree, as without a tier.
- `match_and_load` continues a match through host-only nodes and copies them back into new
  device pages (before the extend that would otherwise recompute them), locking the matched
  prefix meanwhile so that making room cannot evict it.
- A host-only node a request recomputed anyway takes the request's pages at insert.
- A host page is freed by the node that holds it, when the node is dropped; a device page as
  before. check_integrity counts both pools against the nodes.
- Copies are queued (tier_copies.py) and run when the next batch launches, layer by layer; its
  forward waits for each layer before touching it. Anything else that takes device pages from the
  cache's allocator to hand on (a PD room) settles the queue first.
- The disk tier backs up what the host tier takes (and a device leaf the host had no room for,
  as it goes), a page a file named by its block hash; a match that runs past the device and host
  continues there.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from tandem.engine.kvcache.kv_events import DEVICE, HOST, block_hashes
from tandem.engine.kvcache.prefix_cache import MatchResult

TreeNode = Any  # radix_cache.TreeNode: not imported, radix_cache imports this module


class LowerTiers:
    """Mixed into RadixCache: every method here reads and writes its tree."""

    def match_and_load(self, token_ids: list[int]) -> MatchResult:
        """match_prefix, continued through host-only nodes that are copied back to the device
        (as many whole nodes as the device has room for, evicting other unlocked entries)."""
        match = self.match_prefix(token_ids)
        if self.host is None:
            return match
        P = self.page_size
        key = list(token_ids[: len(token_ids) - len(token_ids) % P])
        node, pos, path = match.last_node, match.indices.numel(), []
        while pos < len(key):
            child = node.children.get(tuple(key[pos : pos + P]))  # type: ignore[attr-defined]
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock  # the match's tick: parents stay no older than children
            path.append(child)
            node, pos = child, pos + n
        if not path:
            return self._disk_continuation(match, key)
        self.inc_lock_ref(match.last_node)  # making room must not evict the prefix matched so far
        self._loading = {c.node_id for c in path}
        loaded: list[torch.Tensor] = []
        try:
            short = sum(len(c.key) for c in path) - self.allocator.available_size()
            if short > 0:
                self.evict(short)
            for child in path:
                pages = self.allocator.alloc_pages(len(child.key) // P)
                if pages is None:
                    break
                slots = (pages[:, None] * P + torch.arange(P)).flatten().to(self.device)
                self.host.load(child.host, slots)  # type: ignore[arg-type]  # host-only: host set
                child.slots = slots
                self._evictable += len(child.key)
                loaded.append(slots)
                self._stored(child, DEVICE)
        finally:
            self._loading = set()
            self.dec_lock_ref(match.last_node)
        if not loaded:
            return match
        last = path[len(loaded) - 1]
        result = MatchResult(torch.cat([match.indices, *loaded]), last, host_hit=sum(x.numel() for x in loaded))
        return self._disk_continuation(result, key) if len(loaded) == len(path) else result

    def launch_copies(self) -> object | None:
        return self.host.launch() if self.host is not None else None

    def settle(self) -> None:
        if self.host is not None:
            self.host.drain()

    def _disk_continuation(self, match: MatchResult, key: list[int]) -> MatchResult:
        """A match extended by what the disk tier holds past its end (match_and_load's last step)."""
        pos = match.indices.numel()
        if self.disk is None or pos >= len(key) - len(key) % self.page_size:
            return match
        node: Any = match.last_node  # a RadixCache match: a TreeNode
        if node.children.get(tuple(key[pos : pos + self.page_size])) is not None:
            return match  # the tree holds this page (a host copy it could not load): not the disk's
        last, slots = self._load_from_disk(node, key, pos)
        if slots is None:
            return match
        return MatchResult(torch.cat([match.indices, slots]), last, host_hit=match.host_hit + slots.numel())

    def _host_write(self, node: TreeNode) -> torch.Tensor | None:
        """Copy a device node's pages to the host tier, dropping its least recent host-only
        leaves for room; the host slots, or None when even that leaves too little."""
        host, slots = self.host, node.slots
        assert host is not None and slots is not None  # invariant: called only with a tier, on device nodes
        short = slots.numel() - host.allocator.available_size()
        if short > 0:
            self._evict_host(short)
        copy = host.write(slots)
        if copy is not None:
            self._host_held += copy.numel()
            self._stored(node, HOST)
            self._spill(node, copy)  # the disk tier backs up what the host holds: a restart reads it
        return copy

    def _spill(self, node: TreeNode, host_slots: torch.Tensor | None = None) -> None:
        """A node's pages to the disk tier, from its host copy, or its device one (a device leaf
        the host had no room for, just before it goes). Pages already there are not rewritten."""
        host_slots = node.host if host_slots is None else host_slots
        if self.disk is None or (host_slots is None and node.slots is None):
            return
        on_host = host_slots is not None
        slots: torch.Tensor = host_slots if on_host else node.slots  # type: ignore[assignment]
        P, disk, parent = self.page_size, self.disk, self._parent_hash(node)
        pages = [(h, node.key[i * P : (i + 1) * P]) for i, h in enumerate(node.hashes)]

        def put(payloads: list[bytes]) -> None:  # on the copier, once the pages are staged
            prev = parent
            for (h, tokens), payload in zip(pages, payloads):
                disk.put(h, prev, tokens, payload)
                prev = h

        self.host.spill(slots, on_host, put)  # type: ignore[union-attr]  # a disk tier implies a host tier

    def _load_from_disk(self, node: TreeNode, key: list[int], pos: int) -> tuple[TreeNode, torch.Tensor | None]:
        """Continue a match below device node `node` at key[pos:] with the disk tier's pages: as
        many consecutive ones as it holds and the device has room for, as one new device node.
        (the node and its slots; `node` and None when the disk holds none of them)."""
        P = self.page_size
        parent = node.hashes[-1] if node.hashes else None
        pages = len(key[pos:]) // P
        hashes = block_hashes(parent, key[pos : pos + pages * P], P)
        found = 0
        while found < len(hashes) and self.disk.has(hashes[found]):  # type: ignore[union-attr]
            found += 1
        found = self.agree(found)  # every TP rank reaches this with the same tree: they agree here
        if not found:
            return node, None
        self.inc_lock_ref(node)  # making room must not evict the prefix it extends
        try:
            short = found * P - self.allocator.available_size()
            if short > 0:
                self.evict(short)
            got = self.allocator.alloc_pages(min(found, self.allocator.available_size() // P))
        finally:
            self.dec_lock_ref(node)
        if got is None or not got.numel():
            return node, None
        slots = (got[:, None] * P + torch.arange(P)).flatten().to(self.device)
        payloads: list[bytes] = []
        prev = parent
        for i in range(got.numel()):
            payload = self.disk.get(hashes[i], prev, key[pos + i * P : pos + (i + 1) * P])  # type: ignore[union-attr]
            if payload is None:
                break
            payloads.append(payload)
            prev = hashes[i]
        loaded = self.agree(len(payloads))  # a page one rank's disk failed to read: none load it
        del payloads[loaded:]
        if loaded < got.numel():
            self.allocator.free(slots[loaded * P :])
        if not loaded:
            return node, None
        self.host.load_payloads(payloads, slots[: loaded * P])  # type: ignore[union-attr]
        n = loaded * P
        leaf = self._new_node(list(key[pos : pos + n]), slots[:n], node)
        leaf.hashes, leaf.last_access = hashes[:loaded], self._clock
        node.children[tuple(leaf.key[:P])] = leaf
        self._evictable += n
        self._stored(leaf, DEVICE)
        return leaf, leaf.slots

    def _parent_hash(self, node: TreeNode) -> int | None:
        parent = node.parent
        return parent.hashes[-1] if parent is not None and parent.hashes else None

    def _stored(self, node: TreeNode, medium: str) -> None:
        if self.events is not None:
            self.events.stored(node.hashes, self._parent_hash(node), node.key, medium)

    def _removed(self, node: TreeNode, medium: str) -> None:
        if self.events is not None:
            self.events.removed(node.hashes, medium)

    def _evict_host(self, num_tokens: int) -> int:
        """Drop host-only leaves, least recent first, until `num_tokens` host tokens are free."""
        def host_leaf(n: TreeNode) -> bool:
            return n.slots is None and not n.children and n.node_id not in self._loading

        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.key)
            self._drop(leaf)
            if parent is not None and parent is not self.root and host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed
