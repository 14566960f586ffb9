"""cache_aware: each prefix group (a tenant) on the workers it was placed on, placed so that
the traffic volume per worker stays balanced, and copied rather than moved when one worker
carries too much. How and why: docs/router.md, "Cache-aware placement"."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.router.kv_event_index import EventIndex
from tandem.router.policies.base import Policy, least_tokens
from tandem.router.prefix_index import PrefixIndex
from tandem.router.workers import Worker

HALF_LIFE = 16  # picks per worker in the pool: volumes follow the tenants there are now
YOUNG = 16  # picks per worker: how long a new group counts as an average one
MAX_GROUPS = 1 << 14  # groups remembered (LRU)


@dataclass
class _Group:
    owners: list[str]
    born: int  # pick
    seen: int  # pick of its last request


class Placement:
    """Groups' owners, and each worker's volume (decayed requests routed to it)."""

    def __init__(self, max_groups: int = MAX_GROUPS) -> None:
        self.groups: OrderedDict[int, _Group] = OrderedDict()
        self.volume: dict[str, float] = {}
        self.max_groups, self.picks, self.live = max_groups, 0, 0
        # Young groups, oldest first, as (pick born, worker placed on); per worker, their number
        # and the sum of their birth picks: the projection in O(workers), not O(young groups).
        self._born: deque[tuple[int, str]] = deque()
        self._young: dict[str, list[int]] = {}
        self._seen: deque[tuple[int, int]] = deque()  # (pick, group) within the live window
        # Decay without touching every count: a pick weighs `unit`, which grows by 2^(1/half life).
        self.unit = 1.0

    def group(self, key: int) -> _Group | None:
        return self.groups.get(key)

    def place(self, key: int, url: str) -> None:
        if key in self.groups:  # known, but none of its owners is in the pool any more
            self.groups[key].owners = [url]
            return
        self.groups[key] = _Group([url], self.picks, self.picks)
        self._born.append((self.picks, url))
        y = self._young.setdefault(url, [0, 0])
        y[0], y[1] = y[0] + 1, y[1] + self.picks
        while len(self.groups) > self.max_groups:
            self.groups.popitem(last=False)

    def of(self, url: str) -> float:
        return self.volume.get(url, 0.0)

    def projected(self, pool: int) -> dict[str, float]:
        """Volume, plus for each young group an average live group's volume, fading with age (on
        the worker it was placed on: a young group is seldom copied yet)."""
        young = YOUNG * pool
        self._expire(young)
        out = dict(self.volume)
        average = sum(self.volume.values()) / max(1, self.live)
        for url, (n, born_sum) in self._young.items():
            # sum over its young groups of 1 - age/young
            out[url] = out.get(url, 0.0) + average * (n - (n * self.picks - born_sum) / young)
        return out

    def count(self, key: int | None, url: str, pool: int) -> None:
        """One request routed to `url` out of a pool of `pool` workers."""
        half_life = HALF_LIFE * pool
        window = half_life / math.log(2)  # the mean age of what the volumes weigh: seen within it, live
        self.picks += 1
        self.unit *= 2 ** (1 / half_life)
        self.volume[url] = self.of(url) + self.unit
        g = self.groups.get(key) if key is not None else None
        if g is not None:
            self.groups.move_to_end(key)
            if g.seen == g.born or self.picks - g.seen >= window:
                self.live += 1  # its first request, or back after a pause
            g.seen = self.picks
            self._seen.append((self.picks, key))
        while self._seen and self.picks - self._seen[0][0] >= window:
            pick, k = self._seen.popleft()
            old = self.groups.get(k)
            if old is not None and old.seen == pick:
                self.live -= 1  # its last request left the window
        self._expire(YOUNG * pool)
        if self.unit > 2.0**40:
            self.volume = {k: v / self.unit for k, v in self.volume.items()}
            self.unit = 1.0

    def slack(self, requests: float) -> float:
        return requests * self.unit

    def _expire(self, young: int) -> None:
        while self._born and self.picks - self._born[0][0] >= young:
            born, url = self._born.popleft()
            y = self._young[url]
            y[0], y[1] = y[0] - 1, y[1] - born


class CacheAware(Policy):
    name = "cache_aware"
    reads_tokens = True

    def __init__(self, index: PrefixIndex | EventIndex | None = None, threshold: float = 0.3, balance: float = 1.3,
                 balance_abs: int = 4, volume_balance: float = 1.15, volume_slack: float = 3.0,
                 seed: int | None = None) -> None:
        super().__init__(index, seed)
        self.threshold, self.balance, self.balance_abs = threshold, balance, balance_abs
        self.volume_balance, self.volume_slack = volume_balance, volume_slack
        self.placement = Placement()
        self._uncached = [0.0, 0.0]  # prompt tokens picks found uncached, and picks; both decayed

    @classmethod
    def configured(cls, *, threshold: float, balance: float, seed: int | None) -> CacheAware:
        return cls(threshold=threshold, balance=balance, seed=seed)

    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        assert workers, "no eligible worker"  # invariant: Proxy._route picks only from a non-empty pool
        names = self.index.names(ids)
        w = self._cache_aware(workers, names, len(ids))
        matched = self.index.match(w.url, names) * self.index.block if names else 0
        if names:
            self.index.insert(w.url, names)
            u = self._uncached
            u[0], u[1] = u[0] * 63 / 64 + len(ids) - matched, u[1] * 63 / 64 + 1
        return w, matched

    def owners(self, ids: Sequence[int]) -> list[str]:
        """The workers this prompt's group lives on (cache_aware), sorted."""
        key = self._key(self.index.names(ids), len(ids))[1]
        g = self.placement.group(key) if key is not None else None
        return sorted(g.owners) if g else []

    def _key(self, names: list[int], n: int) -> tuple[int, int | None]:
        """(blocks held to count as a hit, the group's name). The name is the prefix at a power of
        two blocks, the largest not past a hit's: a tenant's prompts, of somewhat different lengths,
        share it."""
        need = max(1, math.ceil(self.threshold * n / self.index.block))
        depth = 1 << (need.bit_length() - 1)
        return need, names[depth - 1] if len(names) >= depth else None

    def _cache_aware(self, workers: Sequence[Worker], names: list[int], n: int) -> Worker:
        need, key = self._key(names, n)
        w = self._choose(workers, names, need, key)
        if self.index.match(w.url, names) >= need:
            self.hits += 1
        else:
            self.misses += 1
        self.placement.count(key, w.url, len(workers))
        return w

    def _choose(self, workers: Sequence[Worker], names: list[int], need: int, key: int | None) -> Worker:
        loads = [w.requests for w in workers]
        balanced = (max(loads) - min(loads) <= self.balance_abs
                    or max(loads) + 1 <= self.balance * (min(loads) + 1))
        p = self.placement
        least = min(p.of(w.url) for w in workers)
        # Within the bound; never empty (the lightest is in it).
        fair = [w for w in workers if p.of(w.url) <= self.volume_balance * least + p.slack(self.volume_slack)]
        owners = self._owners(workers, names, need, key) if key is not None else []
        if not owners:  # a new group (or a prompt shorter than a block)
            proj = p.projected(len(workers))
            w = min(fair, key=lambda w: (proj.get(w.url, 0.0), w.tokens)) if balanced else least_tokens(fair)
            if key is not None:
                p.place(key, w.url)
            return w
        ok = [w for w in owners if w in fair]
        if ok and balanced:
            return max(ok, key=lambda w: (self.index.match(w.url, names), -p.of(w.url)))
        if ok:
            best = min(ok, key=lambda w: (w.requests, w.tokens))
            if not self._too_busy(best, min(loads), self.index.match(best.url, names)):
                return best
        # Past the bound, or too busy: a fair holder that is not busy (a hit), else by load (a copy).
        holders = [w for w in fair if self.index.match(w.url, names) >= need
                   and (balanced or w.requests - min(loads) <= self.balance_abs)]
        pool = holders or fair
        w = min(pool, key=lambda w: (p.of(w.url), w.tokens)) if balanced else least_tokens(pool)
        g = p.group(key)
        if g is not None and w.url not in g.owners:
            g.owners.append(w.url)  # it holds the prefix now: an owner, its later requests hit
        return w

    def _owners(self, workers: Sequence[Worker], names: list[int], need: int, key: int) -> list[Worker]:
        """The group's owners in this pool. A group unknown (or whose owners all left the pool) is
        adopted by the worker estimated to hold most of the prompt, if one holds `threshold` of it."""
        g = self.placement.group(key)
        owners = [w for w in workers if g is not None and w.url in g.owners]
        if owners:
            return owners
        holders = [w for w in workers if self.index.match(w.url, names) >= need]
        if not holders:
            return []
        best = max(holders, key=lambda w: (self.index.match(w.url, names), -self.placement.of(w.url)))
        self.placement.place(key, best.url)
        return [best]

    def _too_busy(self, w: Worker, idlest: int, cached_blocks: int) -> bool:
        """More than balance_abs requests beyond the idlest, and that queue's uncached tokens are worth
        more than twice the cached ones a request elsewhere recomputes (an uncached prompt: at once)."""
        excess = w.requests - idlest
        uncached = self._uncached[0] / max(1.0, self._uncached[1])  # per request, lately
        return excess > self.balance_abs and excess * uncached > 2 * cached_blocks * self.index.block


class KVEventsAware(CacheAware):
    """cache_aware's placement on what the workers report they hold (their KV events,
    router/kv_event_index.py) instead of what the router estimates from what it sent them."""

    name = "kv_events"

    @classmethod
    def configured(cls, *, threshold: float, balance: float, seed: int | None) -> CacheAware:
        return cls(EventIndex(), threshold=threshold, balance=balance, seed=seed)
