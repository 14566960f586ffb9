"""The FP8 KV cache (`kv_cache_dtype=fp8_e4m3 | fp8_e5m2`, kvcache/kv_memory.py): the pool stores a
byte a value, attention upcasts what it reads, and the real model still picks HF's next token.

Greedy answers of a 135M model drift apart once one token differs, so the accuracy goal is held
teacher-forced: along the bf16-KV answer to the fixed chat set, each next token is asked of the
fp8 pool (the prefix read from its cache, as a decode step reads it) and must be the same on at
least 90% of positions. bench/fp8_kv_drift.py reports the free-running agreement and the
logprob drift beside it (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from tandem import Engine

FP8 = ["fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("kv", FP8)
def test_the_pool_stores_a_byte_a_value_and_says_so(engine, kv: str) -> None:
    base = engine(max_total_tokens=2048, page_size=4)
    fp8 = engine(kv_cache_dtype=kv, max_total_tokens=2048, page_size=4)
    full, half = base.scheduler.runner.kv_pool.kv_buffer, fp8.scheduler.runner.kv_pool.kv_buffer
    assert half.element_size() == 1 and half.nbytes * full.element_size() == full.nbytes
    state = fp8.status()[0].info
    assert state["kv_dtype"] == {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv]
    assert state["capacity_tokens"] == base.status()[0].info["capacity_tokens"]
    # Prefill, cache hits, chunks and decode all run on it; the pool is whole after.
    prompts = [[5, 6, 7, 8] * 9, [5, 6, 7, 8] * 9 + [9, 10], list(range(40, 90))]
    outs = fp8.generate(prompts, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert all(len(o["token_ids"]) == 12 for o in outs)


def test_fp8_is_refused_where_nothing_reads_it(engine) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        engine(kv_cache_dtype="fp8")
    with pytest.raises(Exception, match="deterministic mode reads the KV through the extend kernel"):
        engine(kv_cache_dtype="fp8_e4m3", deterministic=True, dtype="bfloat16")


@pytest.mark.parametrize("kv", FP8)
def test_the_real_model_picks_the_same_next_token_on_fp8_kv(smollm2, smollm2_reference, kv: str) -> None:
    prompts = [case["prompt_ids"] for case in smollm2_reference]  # the fixed chat set (tests/conftest.py)
    sp = {"max_new_tokens": 1, "temperature": 0}
    with Engine(str(smollm2), dtype="bfloat16", max_total_tokens=8192) as eng:
        answers = [o["token_ids"] for o in eng.generate(prompts, {**sp, "max_new_tokens": 40})]
    steps = [(p + a[:i], a[i]) for p, a in zip(prompts, answers) for i in range(len(a))]
    with Engine(str(smollm2), dtype="bfloat16", kv_cache_dtype=kv, max_total_tokens=16384) as eng:
        got = []
        for p, a in zip(prompts, answers):  # one chat at a time: each step hits the previous one's cache
            got += [o["token_ids"][0] for o in eng.generate([p + a[:i] for i in range(len(a))], sp)]
        assert all(r.ok for r in eng.flush_cache())
    agree = sum(g == want for g, (_, want) in zip(got, steps)) / len(steps)
    assert agree >= 0.9, agree
