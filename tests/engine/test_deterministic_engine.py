"""Deterministic mode through the whole engine, in bf16: the same prompts give the same tokens
and the same logprobs, bit for bit, alone and in mixed batches of other prompts, cold and
after a cache warm-up, chunked and not, mixed-chunk, normal and overlap loops, greedy and
seeded sampling (PD: tests/pd/test_pd_deterministic.py). Pools are whole after each engine."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="deterministic mode runs on the CPU kernels")

BASE = dict(dtype="bfloat16", deterministic=True, max_total_tokens=8192, max_running_requests=32)
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SEEDED = {**GREEDY, "temperature": 0.9, "top_p": 0.9, "seed": 7}
SCENARIOS = {
    "normal": dict(disable_overlap_schedule=True),
    "overlap": dict(disable_overlap_schedule=False),
    "chunked": dict(chunked_prefill_size=8, disable_overlap_schedule=True),
    "chunked-overlap": dict(chunked_prefill_size=16, page_size=4, disable_overlap_schedule=False),
    "mixed-chunk": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=True),
    "no-radix": dict(disable_radix_cache=True, disable_overlap_schedule=True),
}


def _prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]


def _key(out: dict) -> tuple:
    return tuple(out["token_ids"]), tuple(out["meta"]["logprobs"] or ())


def _runs(eng, targets: list[list[int]], others: list[list[int]], sp: dict) -> dict[str, list[tuple]]:
    """The targets' (tokens, logprobs) alone, beside others (cold), and again after a warm cache."""
    alone = [_key(eng.generate([t], sp)[0]) for t in targets]
    eng.flush_cache()
    mixed = eng.generate(others[:3] + targets + others[3:], sp)[3 : 3 + len(targets)]
    warm = eng.generate(targets + others[:2], sp)[: len(targets)]  # every target's prompt cached now
    return {"alone": alone, "beside others": [_key(o) for o in mixed], "cache warm": [_key(o) for o in warm]}


@pytest.fixture(scope="module")
def reference(model_path):
    """The targets computed alone by the normal loop without cache tricks: what every run must equal."""
    from tandem import Engine

    with Engine(str(model_path("tiny")), **BASE, disable_overlap_schedule=True, disable_radix_cache=True) as eng:
        targets = _prompts(eng.tokenizer.vocab_size, [5, 23, 61], seed=1)
        others = _prompts(eng.tokenizer.vocab_size, [3, 17, 40, 90, 8], seed=2)
        ref = {name: [_key(eng.generate([t], sp)[0]) for t in targets] for name, sp in
               (("greedy", GREEDY), ("seeded", SEEDED))}
    return targets, others, ref


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_same_bits_in_every_batch_cache_and_loop(engine, model_path, reference, scenario: str) -> None:
    targets, others, ref = reference
    eng = engine("tiny", **BASE, **SCENARIOS[scenario])
    for name, sp in (("greedy", GREEDY), ("seeded", SEEDED)):
        for how, got in _runs(eng, targets, others, sp).items():
            assert got == ref[name], f"{name} sampling, {how}"
    assert all(lp for _, lp in ref["greedy"])  # logprobs were compared, not two empty lists


def test_cached_tokens_were_really_reused(engine, reference) -> None:
    targets, _, _ = reference
    eng = engine("tiny", **BASE, disable_overlap_schedule=True)
    eng.generate([targets[2]], GREEDY)
    again = eng.generate([targets[2]], GREEDY)[0]
    assert again["meta"]["cached_tokens"] >= len(targets[2]) - 1
    assert _key(again) == reference[2]["greedy"][2]


def _second_turn(eng, first: list[int]) -> tuple[list[int], tuple]:
    """Turn 2 of a chat whose turn 1 was `first`: its prompt holds turn 1's answer."""
    answer = eng.generate([first], GREEDY)[0]["token_ids"]
    prompt = first + answer + [11, 12, 13]
    return prompt, _key(eng.generate([prompt], GREEDY)[0])


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_second_turn_reusing_decoded_kv_equals_it_recomputed(engine, reference, deterministic: bool) -> None:
    """Turn 2 reads turn 1's answer from the cache, where decode steps wrote it; recomputed, the
    same tokens come from one extend. Only deterministic mode makes the two agree: the default
    decode kernel sums in another order than the extend kernel (the check has teeth)."""
    targets, _, _ = reference
    config = {**BASE, "deterministic": deterministic, "disable_overlap_schedule": True}
    warm = engine("tiny", **config)
    prompt, reused = _second_turn(warm, targets[1])
    cold = engine("tiny", **config, disable_radix_cache=True)
    recomputed = _key(cold.generate([prompt], GREEDY)[0])
    assert warm.generate([prompt], GREEDY)[0]["meta"]["cached_tokens"] >= len(prompt) - 4
    assert (reused == recomputed) is deterministic


def test_an_unseeded_sampled_request_draws_the_same_tokens_again(engine, reference) -> None:
    """Without a seed a request gets a random one, and another answer each time; deterministic mode
    gives it a fixed seed (DETERMINISTIC_SEED), so the newcomer's repeated question repeats its answer."""
    targets, others, _ = reference
    unseeded = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    eng = engine("tiny", **BASE, disable_overlap_schedule=True)
    first = eng.generate([targets[1]], unseeded)[0]["token_ids"]
    assert eng.generate([targets[1]], unseeded)[0]["token_ids"] == first  # from the cache this time
    assert eng.generate(others[:2] + [targets[1]], unseeded)[2]["token_ids"] == first
    default = engine("tiny", **{**BASE, "deterministic": False})
    draws = {tuple(default.generate([targets[1]], unseeded)[0]["token_ids"]) for _ in range(3)}
    assert len(draws) > 1  # the default mode draws anew
