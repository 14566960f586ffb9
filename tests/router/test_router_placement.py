"""cache_aware placement (router/policies/cache_aware.py), deterministic and server-free: tenants stay whole
while the pool is balanced, new tenants are spread even when their first requests come unevenly,
a worker past its share copies the excess to the lightest worker (the tenant stays where it is),
a tenant hotter than a fair share spreads, misses go by load, no pick goes past the bound, and a
busy owner keeps a request whose cached prefix is worth more than its queue."""

from __future__ import annotations

import random
from collections import Counter

from tandem.router.policies import CacheAware
from tandem.router.prefix_index import PrefixIndex
from tandem.router.workers import Worker

RNG = random.Random(0)
TENANTS = [[RNG.randrange(10, 8000) for _ in range(64)] for _ in range(8)]  # 8 system prompts, 16 blocks


def _pool(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}") for i in range(n)]


def _policy(**kw: float) -> CacheAware:
    return CacheAware(PrefixIndex(block=4), **kw)


def _ask(pol: CacheAware, pool: list[Worker], tenant: int, i: int) -> Worker:
    """One request of `tenant`: its system prompt and a question of its own."""
    return pol.pick(pool, TENANTS[tenant] + [10 + i % 7000] * 4)[0]


def test_tenants_stay_whole_while_balanced() -> None:
    pool, pol = _pool(4), _policy()
    homes: dict[int, set[str]] = {}
    for i in range(160):  # 8 tenants of equal volume, nothing in flight
        homes.setdefault(i % 8, set()).add(_ask(pol, pool, i % 8, i).url)
    assert all(len(h) == 1 for h in homes.values()), homes  # never copied
    assert sorted(Counter(next(iter(h)) for h in homes.values()).values()) == [2, 2, 2, 2]
    assert pol.misses == 8  # one per tenant


def test_new_tenants_spread_though_their_first_requests_are_uneven() -> None:
    """Tenant 0 brings most of the first requests. By counts alone, the workers holding young
    tenants look light and get a third one; counted as average tenants, every worker gets two."""
    pool, pol = _pool(4), _policy()
    first: dict[int, str] = {}
    for i, t in enumerate([0, 0, 0, 1, 0, 2, 1, 0, 3, 4, 0, 1, 5, 6, 2, 7]):
        first.setdefault(t, _ask(pol, pool, t, i).url)
    assert sorted(Counter(first.values()).values()) == [2, 2, 2, 2]


def test_past_its_share_the_excess_is_copied_and_the_tenant_stays() -> None:
    pool, pol = _pool(2), _policy()
    home = _ask(pol, pool, 0, 0)
    other = next(w for w in pool if w is not home)
    _ask(pol, pool, 1, 1)  # a light tenant on the other worker
    served = Counter(_ask(pol, pool, 0, i).url for i in range(2, 60))
    # Tenant 0 alone outgrows its worker's share: the other worker gets a copy (one miss) and
    # from then on the tenant's requests go to whichever carries less. Its home keeps serving it.
    assert served[home.url] > 20 and served[other.url] > 20, served
    assert pol.misses == 3  # tenant 0, tenant 1, the one copy
    assert pol.owners(TENANTS[0]) == sorted([home.url, other.url])


def test_a_tenant_hotter_than_a_fair_share_spreads_over_the_pool() -> None:
    pool, pol = _pool(4), _policy()
    served = Counter(_ask(pol, pool, 0, i).url for i in range(200))
    assert len(served) == 4 and max(served.values()) <= 1.3 * min(served.values()), served
    assert pol.misses == 4  # one copy per worker, then hits


def test_misses_go_to_the_lightest_worker() -> None:
    pool, pol = _pool(2), _policy()
    a, b = _ask(pol, pool, 0, 0), _ask(pol, pool, 1, 1)
    assert a is not b
    for i in range(3):  # tenant 0's worker carries more
        _ask(pol, pool, 0, 2 + i)
    assert _ask(pol, pool, 2, 9) is b  # the lighter one, not the one with the smaller tree
    # Load in flight imbalanced (5 ahead): a new prompt goes to the fewest outstanding tokens.
    pool = _pool(3)
    for w, (requests, tokens) in zip(pool, [(6, 600), (0, 50), (1, 10)]):
        w.requests, w.tokens = requests, tokens
    assert _ask(_policy(), pool, 3, 0) is pool[2]


def test_no_pick_goes_past_the_bound() -> None:
    pool, pol = _pool(4), _policy()
    rng = random.Random(1)
    served: Counter[str] = Counter()
    for i in range(600):
        p = pol.placement
        bound = pol.volume_balance * min(p.of(w.url) for w in pool) + p.slack(pol.volume_slack)
        t = rng.choices(range(8), weights=[8, 4, 2, 2, 1, 1, 1, 1])[0]  # one tenant a third of it all
        w = _ask(pol, pool, t, i)
        assert p.of(w.url) - p.unit <= bound + 1e-9, i  # its volume before this pick
        served[w.url] += 1
    assert max(served.values()) <= 1.2 * min(served.values()), served


def test_a_busy_owner_keeps_a_hit_whose_prefix_outweighs_its_queue() -> None:
    pool, pol = _pool(2), _policy(volume_slack=1e6)  # in flight only: no volume bound here
    home = _ask(pol, pool, 0, 0)
    other = next(w for w in pool if w is not home)
    for i in range(1, 6):
        _ask(pol, pool, 0, i)  # hits: requests lately bring ~4 uncached tokens each
    home.requests = 6  # 6 ahead of the idle worker: imbalanced, and past balance_abs
    # 6 queued requests x their few uncached tokens < twice the 64 cached ones: it waits.
    assert _ask(pol, pool, 0, 6) is home
    for _ in range(40):  # traffic turns to prompts nobody has cached: a queue is dear now
        pol.pick([home], [RNG.randrange(10, 8000) for _ in range(64)])
    assert _ask(pol, pool, 0, 7) is other  # leaves the busy owner, as before
