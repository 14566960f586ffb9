"""The host tier in the engine (`enable_hierarchical_cache`): a multi-turn workload whose working
set is several times the device pool answers with the same greedy tokens with the tier and
without it, in the normal, overlap and chunked loops, while pages are evicted to the host and
loaded back mid-run; the second turns find their first turns in the host tier
(`cached_tokens` counts them), and both pools are whole after (the `engine` fixture checks)."""

from __future__ import annotations

import pytest

SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SYSTEM = list(range(300, 340))  # a shared system prompt of 40 tokens


def _chats(n: int) -> list[list[int]]:
    return [SYSTEM + [1000 + 37 * c + j for j in range(30)] for c in range(n)]


def _two_turns(eng, chats: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Every chat's first turn, then every second turn (its first turn, answer and 10 more
    tokens): by then the device pool has evicted most first turns. Tokens, and the second turns'
    cached tokens."""
    tokens, cached = [], []
    firsts = [eng.generate([c], SP)[0] for c in chats]
    for c, first in zip(chats, firsts):
        second = eng.generate([c + first["token_ids"] + list(range(2000, 2010))], SP)[0]
        tokens += [first["token_ids"], second["token_ids"]]
        cached.append(second["meta"]["cached_tokens"])
    return tokens, cached


MODES = {
    "normal": {"disable_overlap_schedule": True},
    "overlap": {"disable_overlap_schedule": False},
    "chunked": {"disable_overlap_schedule": True, "chunked_prefill_size": 16},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_tokens_are_the_same_with_and_without_the_host_tier(engine, mode: str) -> None:
    chats = _chats(8)  # 8 x ~90 tokens of KV through a pool of 192
    base = dict(max_total_tokens=192, page_size=4, **MODES[mode])
    want, cached_without = _two_turns(engine(**base), chats)
    tiered = engine(**base, enable_hierarchical_cache=True, hicache_ratio=8.0, hicache_write_policy="write_back")
    got, cached_with = _two_turns(tiered, chats)
    assert got == want
    host = tiered.status()[0].info["host_tier"]
    assert host["loaded_tokens"] > 0 and host["written_tokens"] > 0, host
    # A second turn holds its first turn's prompt and answer: the tier finds what the pool lost.
    assert sum(cached_with) > sum(cached_without), (cached_with, cached_without)
    assert min(cached_with) >= 60, cached_with


def test_write_through_answers_alike(engine) -> None:
    chats = _chats(6)
    base = dict(max_total_tokens=160, page_size=4, disable_overlap_schedule=True)
    want, _ = _two_turns(engine(**base), chats)
    tiered = engine(**base, enable_hierarchical_cache=True, hicache_size=0.001)  # 1 MiB: a size, not a ratio
    got, _ = _two_turns(tiered, chats)
    assert got == want
    host = tiered.status()[0].info["host_tier"]
    assert host["capacity_tokens"] > 0 and host["loaded_tokens"] > 0


def test_the_tier_needs_the_radix_cache_and_a_known_policy(engine) -> None:
    with pytest.raises(ValueError, match="tier of the radix cache"):
        engine(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache_write_policy must be one of write_through, write_back"):
        engine(enable_hierarchical_cache=True, hicache_write_policy="write_through_selective")


def test_tensor_parallel_ranks_keep_their_tiers_in_step(engine) -> None:
    """Each TP rank has its own host tier; the ranks evict, write and load alike (the batch
    digest would catch a rank that differed), and answer as a single rank does."""
    chats = _chats(6)
    base = dict(max_total_tokens=160, page_size=4, disable_overlap_schedule=True)
    want, _ = _two_turns(engine(**base), chats)
    tp = engine(**base, tp_size=2, debug_tp_digest=True, enable_hierarchical_cache=True, hicache_ratio=8.0,
                hicache_write_policy="write_back")
    got, cached = _two_turns(tp, chats)
    assert got == want and min(cached) >= 60
    assert tp.status()[0].info["host_tier"]["loaded_tokens"] > 0
