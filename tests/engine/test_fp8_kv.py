"""The FP8 KV cache (`kv_cache_dtype=fp8_e4m3 | fp8_e5m2`, kvcache/kv_memory.py): the pool stores a
byte a value, attention upcasts what it reads, and the real model still picks HF's next token.

Greedy answers of a 135M model drift apart once one token differs, so the accuracy goal is held
teacher-forced: along the bf16-KV answer to the fixed chat set, each next token is asked of the
fp8 pool (the prefix read from its cache, as a decode step reads it) and must be the same on at
least 90% of positions. bench/fp8_kv_drift.py reports the free-running agreement and the
logprob drift beside it (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from model_variants import with_kv_scales
from smoke import full_only

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


@pytest.mark.parametrize("kv", ["fp8_e4m3",
                                pytest.param("fp8_e5m2", marks=full_only("fp8_e4m3 through the same path"))])
def test_the_real_model_picks_the_same_next_token_on_fp8_kv(smollm2, smollm2_reference, kv: str) -> None:
    prompts = [case["prompt_ids"] for case in smollm2_reference]  # the fixed chat set (tests/conftest.py)
    sp = {"max_new_tokens": 1, "temperature": 0}
    # dtype auto: bf16 where the CPU computes it (the usual pairing with an fp8 cache), fp32 where
    # torch would emulate it several times slower; what is tested is the cache's dtype.
    with Engine(str(smollm2), dtype="auto", max_total_tokens=8192) as eng:
        answers = [o["token_ids"] for o in eng.generate(prompts, {**sp, "max_new_tokens": 40})]
    steps = [(p + a[:i], a[i]) for p, a in zip(prompts, answers) for i in range(len(a))]
    with Engine(str(smollm2), dtype="auto", kv_cache_dtype=kv, max_total_tokens=16384) as eng:
        got = []
        for p, a in zip(prompts, answers):  # one chat at a time: each step hits the previous one's cache
            got += [o["token_ids"][0] for o in eng.generate([p + a[:i] for i in range(len(a))], sp)]
        assert all(r.ok for r in eng.flush_cache())
    agree = sum(g == want for g, (_, want) in zip(got, steps)) / len(steps)
    print(f"{kv}: {agree:.3f} of {len(steps)} next tokens agree")
    assert agree >= 0.9, agree


# ---- per-tensor scales from the checkpoint (kvcache/kv_scales.py) ------------------------------


def test_scale_names_are_the_ones_exporters_write() -> None:
    from tandem.engine.kvcache.kv_scales import kv_scale_weight

    assert kv_scale_weight("layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_weight("model.layers.0.self_attn.v_scale") == (0, "v")
    assert kv_scale_weight("layers.1.self_attn.kv_scale") == (1, "kv")  # the older single scale
    assert kv_scale_weight("layers.2.self_attn.k_proj.output_scale") == (2, "k")  # ModelOpt
    assert kv_scale_weight("layers.2.self_attn.v_proj.v_scale") == (2, "v")
    for other in ("layers.2.self_attn.k_proj.weight", "layers.2.self_attn.k_proj.v_scale",
                  "layers.2.mlp.down_proj.output_scale", "layers.x.self_attn.k_scale"):
        assert kv_scale_weight(other) is None, other


def test_a_scale_from_a_file_is_checked() -> None:
    from tandem.engine.kvcache.kv_scales import KVScales

    s = KVScales.from_checkpoint({(0, "kv"): 2.0, (0, "v"): 0.5, (1, "k"): 4.0}, 3)
    assert (s.k, s.v) == ((2.0, 4.0, 1.0), (0.5, 1.0, 1.0)) and not s.unit  # a layer's own v beats its kv
    assert KVScales.ones(3).digest() == "unit" and s.digest() != "unit"
    for bad in (float("nan"), float("inf"), 0.0, -1.0, 1e9):
        with pytest.raises(ValueError, match="a KV scale must be in"):
            KVScales.from_checkpoint({(0, "k"): bad}, 2)
    with pytest.raises(ValueError, match="layer 5, but the model has 2 layers"):
        KVScales.from_checkpoint({(5, "k"): 1.0}, 2)


def test_the_pool_stores_each_value_over_its_layers_scale() -> None:
    import torch

    from tandem.engine.kvcache.kv_scales import KVScales
    from tandem.engine.kvcache.memory_pool import TokenToKVPool

    scales = KVScales((2.0, 1.0), (0.25, 1.0))
    pool = TokenToKVPool(4, 4, 2, 2, 16, torch.float8_e4m3fn, "cpu", scales=scales)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    loc = torch.tensor([4, 5, 9])
    for layer in (0, 1):
        pool.set_kv(layer, loc, k, v)
        want_k, want_v = k / scales.k[layer], v / scales.v[layer]
        assert torch.equal(pool.k_buffer(layer)[loc].float(), want_k.to(torch.float8_e4m3fn).float())
        assert torch.equal(pool.v_buffer(layer)[loc].float(), want_v.to(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="KV scales are for an fp8 pool"):
        TokenToKVPool(4, 4, 2, 2, 16, torch.bfloat16, "cpu", scales=scales)


def test_checkpoint_scales_are_applied_on_store_and_on_read(engine, model_path, tmp_path) -> None:
    """Scales of powers of two change an e5m2 value's exponent only, so a pool that divides by them
    on store and multiplies them back on read (K's into the softmax scale, V's into the output)
    answers bit for bit as the unscaled pool does; one that forgot either side would be off by 2x
    or 4x. The stored bytes themselves differ."""
    scaled = with_kv_scales(model_path("tiny"), tmp_path / "scaled", k=2.0, v=0.25)
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    prompts = [[5, 6, 7, 8] * 9, [5, 6, 7, 8] * 9 + [9, 10]]  # the second hits the first's cached KV
    runs = {}
    for name, model in (("plain", model_path("tiny")), ("scaled", scaled)):
        eng = engine(model, kv_cache_dtype="fp8_e5m2", dtype="bfloat16", max_total_tokens=2048, page_size=4)
        runs[name] = ([eng.generate(p, sp) for p in prompts], eng.status()[0].info["kv_scales"])
    assert runs["plain"][1] == "unit" and runs["scaled"][1] != "unit"
    plain, scaled_out = runs["plain"][0], runs["scaled"][0]
    assert [o[0]["token_ids"] for o in plain] == [o[0]["token_ids"] for o in scaled_out]
    logprobs = [[o[0]["meta"]["logprobs"] for o in run] for run in (plain, scaled_out)]
    assert logprobs[0] == logprobs[1] and all(logprobs[0])
