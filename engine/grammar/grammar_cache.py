"""Compiled grammars by constraint, and the constraints that failed.

Agents send the same schema again and again, so a compiled grammar is kept (LRU) and a hit
gets a matcher at once. The cache is bounded by bytes as well as by count: one 180 KB enum
compiled to 27 MB, and 256 of those would be 7 GB. A failure is remembered too (bounded, for
FAILURE_TTL seconds), so a hostile schema resent in a loop costs one compile, not one each:
a compile killed at its deadline above all.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

Key = tuple[str, str]  # (kind, text)

FAILURE_TTL = 600.0  # seconds a failed constraint is refused from memory
MAX_FAILURES = 1024  # failed constraints remembered; the oldest are forgotten first


class GrammarCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.ready: OrderedDict[Key, tuple[Any, int]] = OrderedDict()  # (compiled, bytes)
        self.failed: OrderedDict[Key, tuple[str, int, float]] = OrderedDict()  # (why, status, expiry)
        self.bytes = 0

    def get(self, key: Key) -> Any | None:
        hit = self.ready.get(key)
        if hit is None:
            return None
        self.ready.move_to_end(key)
        return hit[0]

    def put(self, key: Key, compiled: Any, size: int) -> None:
        if key in self.ready:
            return
        self.ready[key] = (compiled, size)
        self.bytes += size
        while len(self.ready) > self.max_entries or (self.bytes > self.max_bytes and len(self.ready) > 1):
            _, (_, dropped) = self.ready.popitem(last=False)
            self.bytes -= dropped

    def failure(self, key: Key, now: float) -> tuple[str, int] | None:
        hit = self.failed.get(key)
        if hit is None:
            return None
        if now >= hit[2]:
            del self.failed[key]
            return None
        return hit[0], hit[1]

    def fail(self, key: Key, why: str, status: int, now: float) -> None:
        self.failed.pop(key, None)
        self.failed[key] = (why, status, now + FAILURE_TTL)
        while len(self.failed) > MAX_FAILURES:
            self.failed.popitem(last=False)

    def __len__(self) -> int:
        return len(self.ready)
