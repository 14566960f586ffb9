"""SchedulePolicy: orders the waiting queue before each prefill round.

Cache-aware:  lpm        longest prefix match first (falls back to fcfs past 128 waiting)
              dfs-weight walk the radix tree depth-first, heaviest subtree first, so
                         requests sharing a prefix run back to back
Agnostic:     fcfs, lof (longest output first), random

With priority scheduling, priority (higher first) is the primary key of every
policy. In-batch prefix caching (lpm): a request whose cached prefix is short
(<= CHECK_THRESHOLD) but which shares >= DEPRIORITIZE_THRESHOLD tokens with a
request already ahead of it this round waits, so it can reuse that request's
KV next round instead of recomputing the same prefix now.
"""

from __future__ import annotations

import random
from collections import defaultdict

from tandem.engine.scheduler.req import Req

LPM_FALLBACK_QUEUE_LEN = 128
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


class _TokenTrie:
    """A plain token trie for matching waiting requests against each other."""

    def __init__(self) -> None:
        self.root: dict = {}

    def match_len(self, ids: list[int]) -> int:
        node, n = self.root, 0
        for t in ids:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def insert(self, ids: list[int]) -> None:
        node = self.root
        for t in ids:
            node = node.setdefault(t, {})


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: object, enable_priority: bool, seed: int = 0) -> None:
        self.policy = policy
        self.tree = tree_cache
        self.enable_priority = enable_priority
        self.rng = random.Random(seed)

    def effective_policy(self, queue_len: int) -> str:
        if self.policy == "lpm" and queue_len > LPM_FALLBACK_QUEUE_LEN:
            return "fcfs"  # O(queue x prompt) matching stops paying for itself
        if self.policy in ("lpm", "dfs-weight") and not hasattr(self.tree, "root"):
            return "fcfs"  # no radix tree to be aware of
        return self.policy

    def calc_priority(self, waiting: list[Req]) -> set[str]:
        """Sort `waiting` in place; return rids deprioritised by in-batch prefix caching."""
        policy = self.effective_policy(len(waiting))
        deprioritized: set[str] = set()
        prio = (lambda r: -r.priority) if self.enable_priority else (lambda r: 0)
        if policy in ("lpm", "dfs-weight"):
            for r in waiting:
                m = self.tree.match_prefix((r.origin_input_ids + r.output_ids)[:-1])  # type: ignore[attr-defined]
                r.prefix_indices, r.last_node = m.indices, m.last_node
        if policy == "lpm":
            deprioritized = self._in_batch_deprioritize(waiting)
            waiting.sort(key=lambda r: (prio(r), r.rid in deprioritized, -len(r.prefix_indices), r.arrival_time))
        elif policy == "dfs-weight":
            order = self._dfs_order(waiting)
            waiting.sort(key=lambda r: (prio(r), order[id(r)]))
        elif policy == "lof":
            waiting.sort(key=lambda r: (prio(r), -r.sampling_params.max_new_tokens, r.arrival_time))
        elif policy == "random":
            self.rng.shuffle(waiting)
            waiting.sort(key=prio)  # stable: random within a priority level
        else:  # fcfs
            waiting.sort(key=lambda r: (prio(r), r.arrival_time))
        return deprioritized

    def _in_batch_deprioritize(self, waiting: list[Req]) -> set[str]:
        trie = _TokenTrie()
        out: set[str] = set()
        for r in sorted(waiting, key=lambda r: r.arrival_time):
            if len(r.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                continue  # a long cached prefix: run it, it is cheap
            ids = r.origin_input_ids
            if trie.match_len(ids) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                out.add(r.rid)
            else:
                trie.insert(ids)
        return out

    def _dfs_order(self, waiting: list[Req]) -> dict[int, int]:
        """Visit order of each request under a DFS of the radix tree, children by weight."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        nodes: dict[int, object] = {}
        for r in waiting:
            node = r.last_node
            by_node[id(node)].append(r)
            while node is not None:  # every ancestor carries the request's weight
                nodes[id(node)] = node
                weight[id(node)] += 1
                node = node.parent  # type: ignore[attr-defined]
        order: dict[int, int] = {}
        stack = [self.tree.root]  # type: ignore[attr-defined]
        while stack:
            node = stack.pop()
            for r in sorted(by_node.get(id(node), []), key=lambda r: r.arrival_time):
                order[id(r)] = len(order)
            kids = [c for c in node.children.values() if weight.get(id(c), 0)]
            stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
        for r in waiting:  # requests whose node was evicted meanwhile go last
            order.setdefault(id(r), len(order))
        return order
