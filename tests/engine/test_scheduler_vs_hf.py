"""The whole engine against HF transformers: greedy tokens must be identical in
every scheduling mode, and every scenario ends with the pool whole again."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_checks import assert_whole
from smoke import full_only

ARCHS = ["tiny", "tiny-llama", "tiny-qwen2", "tiny-qwen3-moe", "tiny-mixtral"]
MAX_NEW = 20
# Overlap unless a scenario says otherwise: it is the riskier loop (on CPU the default is normal).
BASE = dict(dtype="float32", max_total_tokens=4096, max_running_requests=16, disable_overlap_schedule=False)

SCENARIOS = {
    "normal": dict(disable_overlap_schedule=True),
    "overlap": dict(),
    "chunked": dict(chunked_prefill_size=16, page_size=4),
    "mixed-chunk": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=True),
    "mixed-chunk-overlap": dict(chunked_prefill_size=32, enable_mixed_chunk=True),
    # An optimistic new_token_ratio admits more than fits, so decode must retract.
    "retract": dict(max_total_tokens=192, page_size=4, init_new_token_ratio=0.02, min_new_token_ratio_factor=1.0),
    "page-1": dict(page_size=1),
    "page-16": dict(page_size=16),
    "lpm-no-radix": dict(schedule_policy="lpm", disable_radix_cache=True),
}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    lens = [3, 9, 16, 17, 29, 40, 55, 70]
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]


@functools.lru_cache(maxsize=8)
def _hf_greedy(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def _run(engine, model_path, arch: str, **overrides) -> tuple[list[dict], list[list[int]]]:
    path = model_path(arch)
    eng = engine(arch, **{**BASE, **overrides})
    prompts = _prompts(eng.tokenizer.vocab_size)
    outs = eng.generate(prompts, {"max_new_tokens": MAX_NEW, "temperature": 0})
    assert_whole(eng)
    eng.shutdown()  # before HF's model loads beside it
    return outs, _hf_greedy(str(path), tuple(map(tuple, prompts)))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_identical_to_hf(engine, model_path, arch: str, scenario: str) -> None:
    outs, ref = _run(engine, model_path, arch, **SCENARIOS[scenario])
    assert [o["token_ids"] for o in outs] == ref
    if scenario == "retract":
        assert sum(o["meta"]["retract_count"] for o in outs) > 0, "the small pool never forced a retraction"


@pytest.mark.parametrize("arch", ARCHS)
def test_radix_hits_in_waves(engine, model_path, arch: str) -> None:
    """Requests sharing long prefixes, in two waves: the second reuses the first's KV."""
    eng = engine(arch, **BASE, page_size=4)
    g = torch.Generator().manual_seed(5)
    vocab = eng.tokenizer.vocab_size
    system = torch.randint(10, vocab, (48,), generator=g).tolist()
    prompts = [system + torch.randint(10, vocab, (n,), generator=g).tolist() for n in (5, 9, 13, 2, 7, 11)]
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0}
    first = eng.generate(prompts[:2], sp)
    second = eng.generate(prompts[2:], sp)
    assert all(o["meta"]["cached_tokens"] >= 44 for o in second)
    assert_whole(eng)
    eng.shutdown()
    ref = _hf_greedy(str(model_path(arch)), tuple(map(tuple, prompts)))
    assert [o["token_ids"] for o in first + second] == ref


@pytest.mark.parametrize("arch", [a if a in ("tiny", "tiny-qwen3-moe") else pytest.param(
    a, marks=full_only("tiny and tiny-qwen3-moe")) for a in ARCHS])
def test_dp2_identical_to_hf(engine, model_path, arch: str) -> None:
    outs, ref = _run(engine, model_path, arch, dp_size=2, load_balance_method="total_tokens")
    assert [o["token_ids"] for o in outs] == ref
