"""What each worker's prefix cache holds, exactly, as its KV events say (tandem/protocol/kv_events.py),
behind the same interface as the estimating PrefixIndex (prefix_index.py), so the cache-aware
placement (policies/cache_aware.py) runs on it unchanged: the `kv_events` policy.

    names(ids)         the prompt's block hashes, as the worker computes them (chained, per page)
    match(url, names)  leading names the worker holds, in its device or its host tier

A worker's device tier is closed under parents (a block's parent is there too) and a host-only
block's parent is on the device or the host, so holding a name means holding the prefix it ends:
a binary search finds the match. The events arrive a scheduler step or more after the worker
caches a block, so what the router just sent a worker counts as held for `pending_s` seconds
(`insert`), until the worker's own events confirm or contradict it: the next request of the same
prefix, a moment later, follows the first.

A batch is a worker's bytes: anything not of the expected shape or past the bounds is dropped and
counted (`rejected`), never applied; a worker whose index grows past `capacity` blocks is
forgotten (it then matches nothing) rather than growing the router without bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tandem.protocol.kv_events import DEVICE, HOST, block_hashes

log = logging.getLogger(__name__)
MAX_EVENTS = 100_000  # events in one batch
MAX_BLOCKS = 1 << 16  # block hashes in one event
_MEDIA = (DEVICE, HOST)


def _hashes(v: Any) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_BLOCKS or not all(type(h) is int for h in v):
        raise ValueError("block_hashes must be a list of integers")
    return v


class EventIndex:
    def __init__(self, block: int = 16, capacity: int = 1 << 22, pending_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block, self.capacity, self.pending_s, self.clock = block, capacity, pending_s, clock
        self.held: dict[str, dict[str, set[int]]] = {}
        self.pending: dict[str, dict[int, float]] = {}  # names sent, not yet reported: until when they count
        self.applied = self.rejected = 0

    # ---- PrefixIndex's interface -------------------------------------------------------
    def names(self, ids: Sequence[int]) -> list[int]:
        return block_hashes(None, list(ids), self.block)

    def match(self, worker: str, names: Sequence[int]) -> int:
        tiers = self.held.get(worker, {})
        if not names or not (tiers or self.pending.get(worker)):
            return 0
        dev, host = tiers.get(DEVICE, set()), tiers.get(HOST, set())
        sent, now = self.pending.get(worker, {}), self.clock()
        lo, hi = 0, len(names)  # invariant: names[:lo] held, names[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            n = names[mid - 1]
            if n in dev or n in host or sent.get(n, 0.0) > now:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, worker: str, names: Sequence[int]) -> None:
        """The router sent these to `worker`: held for pending_s, or until its events say."""
        sent = self.pending.setdefault(worker, {})
        until = self.clock() + self.pending_s
        for n in names:
            sent[n] = until
        if len(sent) > self.capacity // 4:  # expired ones, trimmed only when many
            now = self.clock()
            self.pending[worker] = {n: t for n, t in sent.items() if t > now}

    def remove(self, worker: str) -> None:
        self.held.pop(worker, None)
        self.pending.pop(worker, None)

    def size(self, worker: str) -> int:
        """Blocks the worker reported it holds (pending ones aside)."""
        return sum(len(s) for s in self.held.get(worker, {}).values())

    # ---- events --------------------------------------------------------------------------
    def apply(self, worker: str, payload: bytes) -> bool:
        """One batch from `worker`; False (and nothing applied) when it is malformed."""
        try:
            batch = msgspec.msgpack.decode(payload)
            events = self._check(batch)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            self.rejected += 1
            log.warning("kv events from %s: batch dropped: %s", worker, str(e)[:200])
            return False
        tiers = self.held.setdefault(worker, {m: set() for m in _MEDIA})
        sent = self.pending.get(worker, {})
        for ev in events:
            if ev[0] == "AllBlocksCleared":
                for s in tiers.values():
                    s.clear()
                sent.clear()
            elif ev[0] == "BlockStored":
                tiers[ev[6] or DEVICE].update(ev[1])
                for h in ev[1]:
                    sent.pop(h, None)  # reported: the events say from now on
                if ev[4] != self.block:
                    self.block = ev[4]  # the workers' page size: names() must cut pages alike
            else:
                tiers[ev[2] or DEVICE].difference_update(ev[1])
                for h in ev[1]:
                    sent.pop(h, None)
        if self.size(worker) > self.capacity:
            log.warning("kv events from %s: over %d blocks; its index is dropped", worker, self.capacity)
            self.held.pop(worker, None)
        self.applied += 1
        return True

    def clear(self, worker: str) -> None:
        """The worker's stream broke (a gap no replay filled): what it holds is unknown again."""
        self.held.pop(worker, None)
        self.pending.pop(worker, None)

    @staticmethod
    def _check(batch: Any) -> list[list[Any]]:
        """The batch's events, every field checked before any is applied."""
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise ValueError("a batch is [ts, events, dp_rank]")
        events = batch[1]
        if len(events) > MAX_EVENTS:
            raise ValueError(f"more than {MAX_EVENTS} events")
        for ev in events:
            if not isinstance(ev, list) or not ev or not isinstance(ev[0], str):
                raise ValueError("an event is [tag, ...]")
            if ev[0] == "BlockStored":
                if len(ev) < 7:
                    raise ValueError("BlockStored has 7 fields or more")
                _hashes(ev[1])
                if type(ev[4]) is not int or not 1 <= ev[4] <= 1 << 16:
                    raise ValueError("block_size must be a positive integer")
                if ev[6] not in (None, *_MEDIA):
                    raise ValueError(f"unknown medium {str(ev[6])[:32]!r}")
            elif ev[0] == "BlockRemoved":
                if len(ev) < 3:
                    raise ValueError("BlockRemoved has 3 fields or more")
                _hashes(ev[1])
                if ev[2] not in (None, *_MEDIA):
                    raise ValueError(f"unknown medium {str(ev[2])[:32]!r}")
            elif ev[0] != "AllBlocksCleared":
                raise ValueError(f"unknown event {ev[0][:32]!r}")
        return events
