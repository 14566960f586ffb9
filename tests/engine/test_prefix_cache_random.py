"""A seeded random workload over both prefix caches, checking integrity after every step."""

from __future__ import annotations

import random

import pytest
from prefix_cache_support import (
    Env,
    admit,
    extend,
    finish,
    make_env,
)


@pytest.fixture(params=["radix", "none"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def random_step(env: Env, rng: random.Random, bases: list[list[int]]) -> int:
    """One random scheduler action; returns tokens evicted by an explicit evict."""
    op = rng.choice(["admit", "admit", "extend", "extend", "finish", "evict", "match"])
    if op == "admit" and env.pool.available_size() and len(env.running) < 6:
        base = rng.choice(bases)
        prompt = base[: rng.randint(2, len(base))] + [rng.randrange(50) for _ in range(rng.randrange(6))]
        prefix = len(env.cache.match_prefix(prompt[:-1]).indices)
        admit(env, prompt, kv_len=rng.randint(prefix + 1, len(prompt)))  # maybe a first chunk
    elif op == "extend" and env.running:
        req = rng.choice(env.running)
        n = min(rng.randint(1, 2 * env.page), env.pool.max_context_len - req.kv_len)
        if n and extend(env, req, n, new_tokens=[rng.randrange(50) for _ in range(n)]) and rng.random() < 0.6:
            env.cache.cache_unfinished_req(req)
    elif op == "finish" and env.running:
        finish(env, rng.choice(env.running))
    elif op == "evict":
        protected = env.cache.protected_size()
        freed = env.cache.evict(rng.randint(1, 4 * env.page))
        assert env.cache.protected_size() == protected, "evict touched a locked node"
        return freed
    elif op == "match":
        env.cache.match_prefix(rng.choice(bases)[: rng.randrange(40)])
    return 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_workload_keeps_integrity(kind: str, page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    # ~90 tokens of KV: small enough that admissions and extends have to evict.
    env = make_env(kind, page_size, num_pages=24 if page_size == 4 else 90)
    bases = [[rng.randrange(6) for _ in range(rng.randint(8, 24))] for _ in range(4)]
    evicted = 0
    for _ in range(250):
        evicted += random_step(env, rng, bases)
        env.check()
    while env.running:
        finish(env, env.running[0])
    env.check()
    assert (env.cache.evict(10**6) > 0 or evicted > 0) == env.hits
    env.cache.reset()
    assert env.alloc.used_pages == 0
    env.check()
