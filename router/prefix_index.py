"""An approximate radix tree of what each worker has cached, at block granularity.

A prompt's ids are cut into blocks of `block` tokens; block i is named by a hash of blocks
0..i (a chain), so one name stands for a whole prefix, as a path in a radix tree does.
Each worker keeps the names it was sent, LRU-ordered and bounded (`capacity` blocks):
the estimate forgets what the worker's own cache most likely evicted first.

    match(worker, names) = the number of leading names the worker holds (binary search:
                           holding a prefix's name implies holding its parents', modulo
                           eviction, which is why this is an estimate)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_names(ids: Sequence[int], block: int) -> list[int]:
    names, h = [], 0
    for i in range(0, len(ids) - len(ids) % block, block):
        h = hash((h, tuple(ids[i : i + block])))
        names.append(h)
    return names


class PrefixIndex:
    def __init__(self, block: int = 16, capacity: int = 1 << 18) -> None:
        self.block, self.capacity = block, capacity
        self.trees: dict[str, OrderedDict[int, None]] = {}

    def names(self, ids: Sequence[int]) -> list[int]:
        """The prompt's block names (kv_event_index.py's EventIndex names them as workers do)."""
        return block_names(ids, self.block)

    def insert(self, worker: str, names: Sequence[int]) -> None:
        tree = self.trees.setdefault(worker, OrderedDict())
        for n in reversed(names):  # leaf first: a path's parents are fresher than its leaves,
            tree[n] = None         # so LRU eviction trims paths from their ends, as a tree does
            tree.move_to_end(n)
        while len(tree) > self.capacity:
            tree.popitem(last=False)

    def match(self, worker: str, names: Sequence[int]) -> int:
        """Matched prefix, in blocks."""
        tree = self.trees.get(worker)
        if not tree or not names:
            return 0
        lo, hi = 0, len(names)  # invariant: names[:lo] held (estimated), names[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if names[mid - 1] in tree:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def remove(self, worker: str) -> None:
        self.trees.pop(worker, None)

    def size(self, worker: str) -> int:
        return len(self.trees.get(worker, ()))
