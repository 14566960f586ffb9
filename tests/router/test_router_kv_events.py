"""The `kv_events` policy: cache-aware placement on what the workers' KV events report they hold
(router/kv_event_index.py, kv_event_feed.py), instead of the router's estimate. The index is
built from the events a real radix cache emits and must match the cache; a worker's malformed
batch is dropped, never applied; and behind the router, two real workers' caches decide where a
tenant's requests go."""

from __future__ import annotations

import random

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from prefix_cache_support import make_env, random_step, seq  # noqa: E402
from worker_process import Worker, running  # noqa: E402

from tandem.router.kv_event_index import EventIndex  # noqa: E402
from tandem.router.policies import KVEventsAware, make_policy  # noqa: E402
from tandem.router.workers import Worker as RouterWorker  # noqa: E402

encode = msgspec.msgpack.Encoder().encode


def _cached_prefix(cache, tokens: list[int]) -> int:
    """Leading pages of `tokens` the cache holds in any tier (a walk of the tree)."""
    P, node, pos = cache.page_size, cache.root, 0
    while pos + P <= len(tokens):
        child = node.children.get(tuple(tokens[pos : pos + P]))
        if child is None:
            break
        n = cache._common_len(child.key, tokens, pos)
        if n == 0:
            break
        pos += n
        if n < len(child.key):
            break
        node = child
    return pos // P


def test_the_index_matches_the_cache_it_hears_from() -> None:
    """Random traffic on a tiered radix cache whose events go, batch by batch, through the wire
    format into an EventIndex: for any prompt, its match is the cache's own prefix, in pages."""
    rng = random.Random(5)
    env = make_env("tiered", 2, num_pages=24, host_pages=10, events=True)
    log = env.cache.events
    index = EventIndex(block=2)
    hits = 0
    for _ in range(200):
        random_step(env, rng)
        batch = log.drain(dp_rank=0)
        if batch is not None:
            assert index.apply("w", encode(batch))
        probe = seq(env, *[rng.randrange(4) for _ in range(rng.randrange(1, 5))])
        want = _cached_prefix(env.cache, probe)
        assert index.match("w", index.names(probe)) == want
        hits += want > 0
    assert index.rejected == 0 and hits >= 50, hits


BAD = [b"", b"\xc1", encode({"ts": 1}), encode([1.0]), encode([1.0, "x", 0]), encode([1.0, [["Nope"]], 0]),
       encode([1.0, [["BlockStored", ["a"], None, [], 16, None, "GPU", None]], 0]),
       encode([1.0, [["BlockStored", [1], None, [], 0, None, "GPU", None]], 0]),
       encode([1.0, [["BlockStored", [1], None, [], 16, None, "TAPE", None]], 0]),
       encode([1.0, [["BlockRemoved", [1]]], 0]), encode([1.0, [[]], 0])]


@pytest.mark.parametrize("payload", BAD, ids=range(len(BAD)))
def test_a_malformed_batch_is_dropped_whole(payload: bytes) -> None:
    index = EventIndex(block=16)
    good = encode([1.0, [["BlockStored", [7, 8], None, list(range(32)), 16, None, "GPU", None]], 0])
    assert index.apply("w", good)
    assert not index.apply("w", payload)
    assert index.held["w"]["GPU"] == {7, 8} and index.rejected == 1  # nothing of it applied


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=12)
                    | st.binary(max_size=8), lambda c: st.lists(c, max_size=6), max_leaves=40))
def test_any_bytes_a_worker_sends_are_applied_or_dropped_never_raised(value) -> None:
    index = EventIndex(block=16)
    index.apply("w", encode(value))
    index.apply("w", encode([0.0, [value], 0]))
    assert index.match("w", index.names(list(range(64)))) >= 0


def test_the_policy_sends_a_prompt_where_its_prefix_is() -> None:
    pol = make_policy("kv_events", seed=0)
    assert isinstance(pol, KVEventsAware) and isinstance(pol.index, EventIndex)
    pool = [RouterWorker(f"http://10.0.0.{i}:8000") for i in range(4)]
    ids = list(range(500, 564))
    names = pol.index.names(ids)
    pol.index.apply(pool[2].url, encode([1.0, [["BlockStored", names, None, ids, 16, None, "GPU", None]], 0]))
    w, matched = pol.pick(pool, ids + [1, 2, 3])
    assert w is pool[2] and matched == 64


def test_behind_the_router_a_tenant_follows_its_cache(model_path) -> None:
    """Two workers publishing KV events, the router on `--policy kv_events`: four tenants, each a
    long shared prefix, six requests each; after a tenant's first request its others find their
    prefix cached, so the router placed them by what the workers report."""
    model, offset = model_path("tiny"), 3
    workers = [Worker.publishing_kv_events(model, "--page-size", "16", offset=offset) for _ in range(2)]
    router = Worker.router(model, "--policy", "kv_events", "--kv-events-port-offset", str(offset),
                           "--kv-events-replay", workers=workers)
    tenants = [" ".join(f"tenant{t} rule {i}." for i in range(60)) for t in range(4)]
    with running(*workers, router):
        cached, total = 0, 0
        for round_ in range(6):
            for prefix in tenants:
                r = httpx.post(router.url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": f"{prefix} question {round_}:", "max_tokens": 2})
                assert r.status_code == 200, r.text
                if round_:
                    usage = r.json()["usage"]
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    total += usage["prompt_tokens"]
        assert cached / total > 0.8, (cached, total)
        for w in workers:
            assert w.pool()["whole"], w.output()


def test_what_was_just_sent_counts_until_the_worker_reports() -> None:
    """A prefix routed a moment ago counts as held (the worker's events lag a step) until its
    events confirm or contradict it, or pending_s passes."""
    now = [0.0]
    index = EventIndex(block=16, pending_s=2.0, clock=lambda: now[0])
    names = index.names(list(range(64)))
    index.insert("w", names)
    assert index.match("w", names) == 4
    index.apply("w", encode([1.0, [["BlockRemoved", names[2:], "GPU"]], 0]))  # the worker says: not those
    assert index.match("w", names) == 2
    now[0] = 3.0
    assert index.match("w", names) == 0  # never reported: forgotten
    index.insert("w", names)
    index.apply("w", encode([1.0, [["BlockStored", names, None, list(range(64)), 16, None, "GPU", None]], 0]))
    now[0] = 10.0
    assert index.match("w", names) == 4 and not index.pending["w"]  # reported: the events hold it now
