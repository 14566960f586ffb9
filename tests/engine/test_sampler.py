"""The on-device sampler: greedy, filters, seeded determinism, distribution, logprobs."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.runner.sampler import SamplingBatch, _filtered_logprobs, _gumbel, _uniform, sample
from tandem.engine.sampling_params import SamplingParams

V = 50


def _sample(logits: torch.Tensor, params: list[SamplingParams], pos: int = 0):
    sb = SamplingBatch.from_params(params, V, "cpu")
    return sample(logits, sb, torch.full((len(params),), pos, dtype=torch.int64))


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    lg = _logits()
    out = _sample(lg, [SamplingParams(temperature=0.0)] * 4)
    assert torch.equal(out.next_token_ids, lg.argmax(-1))


def test_top_k_one_is_greedy_and_tiny_top_p_keeps_only_the_mode() -> None:
    lg = _logits()
    assert torch.equal(_sample(lg, [SamplingParams(top_k=1)] * 4).next_token_ids, lg.argmax(-1))
    assert torch.equal(_sample(lg, [SamplingParams(top_p=1e-6)] * 4).next_token_ids, lg.argmax(-1))
    assert torch.equal(_sample(lg, [SamplingParams(min_p=1.0)] * 4).next_token_ids, lg.argmax(-1))


def test_seed_makes_sampling_reproducible_and_position_dependent() -> None:
    lg = (_logits(1) / 3).repeat(8, 1)  # a flat distribution, so draws differ
    params = [SamplingParams(seed=s) for s in range(8)]
    a = _sample(lg, params, pos=3).next_token_ids
    assert torch.equal(a, _sample(lg, params, pos=3).next_token_ids)
    assert len(set(a.tolist())) > 1  # different seeds, different draws
    draws = {int(_sample(lg[:1], [SamplingParams(seed=7)], pos=p).next_token_ids) for p in range(20)}
    assert len(draws) > 1  # the same seed moves on with the position


def test_batch_mixes_greedy_and_sampled_rows() -> None:
    lg = _logits(2)
    out = _sample(lg, [SamplingParams(temperature=0.0), SamplingParams(seed=1)])
    assert int(out.next_token_ids[0]) == int(lg[0].argmax())


@pytest.fixture(params=["cpu-kernel", "torch"])
def sampling_path(request, monkeypatch):
    """Run a test through the fused CPU Gumbel-max kernel (at this CPU's level) and through the torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "enabled", lambda op: False)
    else:
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
        monkeypatch.setattr(cpu_kernels, "enabled", lambda op: True)
    return request.param


@pytest.mark.usefixtures("sampling_path")
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2, temperature=1.3),
])
def test_draws_follow_the_filtered_distribution(params: SamplingParams) -> None:
    lg = _logits(1, seed=3)[0]
    n = 4000
    sb = SamplingBatch.from_params(
        [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(n)], V, "cpu")
    ids = sample(lg.repeat(n, 1), sb, torch.zeros(n, dtype=torch.int64)).next_token_ids
    freq = torch.bincount(ids, minlength=V).float() / n
    p = torch.softmax(lg / (params.temperature or 1.0), -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    sp = p[order]
    k_keep = (torch.arange(V) < (params.top_k if params.top_k > 0 else V))
    k_keep &= (sp.cumsum(0) - sp) <= params.top_p
    k_keep &= sp >= params.min_p * sp[0]
    keep[order[k_keep]] = True
    want = torch.where(keep, p, 0.0)
    want /= want.sum()
    assert float(freq[~keep].sum()) == 0.0
    assert float((freq - want).abs().max()) < 0.03


def test_logprobs_are_of_the_raw_distribution() -> None:
    lg = _logits(3)
    out = _sample(lg, [SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3)] * 3)
    raw = torch.log_softmax(lg, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.next_token_ids[:, None]).squeeze(-1))
    torch.testing.assert_close(out.top_logprobs, raw.topk(3, -1).values)
    assert torch.equal(out.top_ids[:, 0], lg.argmax(-1))


@pytest.mark.parametrize("bad", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": 0}, {"min_p": 1.5}, {"max_new_tokens": -1},
])
def test_invalid_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_make_accepts_user_values() -> None:
    p = SamplingParams.make(stop="###", stop_token_ids=[3, 4], max_new_tokens=5)
    assert p.stop == ("###",) and p.stop_token_ids == frozenset({3, 4})


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("batch,vocab", [(64, 8192), (7, 1000), (3, 17), (2, 151936)])
def test_cpu_kernel_draws_the_torch_path_tokens(batch: int, vocab: int) -> None:
    """Same hash, same noise up to the rounding of two logs: the same argmax."""
    g = torch.Generator().manual_seed(batch + vocab)
    logits = torch.randn(batch, vocab, generator=g) * 3
    logits[0, ::3] = float("-inf")  # filtered tokens never win
    seeds = torch.randint(0, 2**40, (batch,), generator=g)
    positions = torch.randint(0, 5000, (batch,), generator=g)
    temps = torch.rand(batch, 1, generator=g) + 0.3
    ref = (torch.log_softmax(logits / temps, -1) + _gumbel(seeds, positions, vocab)).argmax(-1)
    got = cpu_kernels.gumbel_argmax(logits, 1.0 / temps, seeds, positions)
    assert torch.equal(got, ref)
    assert got[0] % 3 != 0


def test_uniform_stays_below_one() -> None:
    u = _uniform(torch.tensor([0, 0xFFFFFFFF, 0xFFFFFE00], dtype=torch.int64))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("vocab", [1000, 8192, 151936])
@pytest.mark.parametrize("filters", [
    {"top_p": 0.95}, {"top_p": 0.3}, {"top_k": 50}, {"top_k": 2}, {"min_p": 0.05},
    {"top_k": 20, "top_p": 0.8, "min_p": 0.01},
], ids=["p0.95", "p0.3", "k50", "k2", "minp", "all"])
def test_cpu_filter_bisection_keeps_the_sorted_sets(vocab: int, filters: dict) -> None:
    """The kernel's bisected thresholds draw what the sorted torch path draws."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(16, vocab, generator=g) * 3
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=i, **filters) for i in range(16)],
                                   vocab, "cpu")
    positions = torch.arange(16)
    ref = (_filtered_logprobs(logits, sb) + _gumbel(sb.seeds, positions, vocab)).argmax(-1)
    assert torch.equal(sample(logits, sb, positions).next_token_ids, ref)



@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("batch,vocab", [(64, 8192), (1, 151936), (3, 5), (4, 16), (4, 33)])
def test_cpu_greedy_argmax_is_torch_argmax(batch: int, vocab: int) -> None:
    """First index of the maximum, ties and all -inf rows included."""
    x = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab))
    x[0] = float("-inf")
    if batch > 1:
        x[1, vocab // 3] = x[1, vocab - 1] = 1e9
    if batch > 2:
        x[2] = 3.0
    assert torch.equal(cpu_kernels.greedy_argmax(x), x.argmax(-1))
