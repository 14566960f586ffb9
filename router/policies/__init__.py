"""Dispatch policies, one class each behind `Policy.pick` (base.py), and their registry.

    round_robin     in turn                                  load.py
    random          uniformly
    least_requests  fewest requests in flight
    least_tokens    fewest outstanding tokens (prompt + max_tokens in flight)
    power_of_two    the less loaded (tokens) of two drawn at random
    cache_aware     prefix groups kept on their owners, volume-balanced   cache_aware.py
    kv_events       cache_aware on what the workers' KV events report they hold (--kv-events-port)

A new policy is a `Policy` subclass and one entry below. docs/router.md explains the choice.
"""

from __future__ import annotations

from tandem.router.policies.base import Policy
from tandem.router.policies.cache_aware import CacheAware, KVEventsAware
from tandem.router.policies.load import LeastRequests, LeastTokens, PowerOfTwo, RoundRobin, Uniform

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, Uniform, LeastRequests, LeastTokens, PowerOfTwo, CacheAware, KVEventsAware)
}


def make_policy(name: str, *, threshold: float = 0.3, balance: float = 1.3, seed: int | None = None) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {name!r}")
    return cls.configured(threshold=threshold, balance=balance, seed=seed)


__all__ = ["POLICIES", "CacheAware", "KVEventsAware", "Policy", "make_policy"]
