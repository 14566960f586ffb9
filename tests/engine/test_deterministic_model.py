"""Deterministic mode at the model: a token's logits and its K/V are the same bits however the
token is computed: alone or beside other requests, cold or after a cached prefix, in one
extend or in chunks, prefilled or decoded one token at a time (docs/engine.md, "Deterministic
mode"). The default mode fails the same comparison, so the test can tell the two apart."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tandem.engine.kernels import cpu_kernels, cpu_plan
from tandem.engine.model_config import RunnerConfig
from tandem.engine.models.batch_invariant import InvariantLinear, tiled
from tandem.engine.models.layers import can_pack_linears
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.static_generate import Seq, StaticBatch

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="deterministic mode runs on the CPU kernels")

PROMPT, GENERATED = 37, 6  # the target: a prompt, then tokens fed back one by one


def _runner(path, dtype: str, deterministic: bool, page_size: int = 1) -> ModelRunner:
    cfg = RunnerConfig(dtype=dtype, device="cpu", page_size=page_size, max_total_tokens=4096,
                       max_running_requests=16, max_context_len=512, deterministic=deterministic)
    return ModelRunner.load(path, cfg)


def _kv(runner: ModelRunner, seq: Seq) -> list[torch.Tensor]:
    slots = torch.tensor(seq.slots[: PROMPT + GENERATED], dtype=torch.int64)
    pool = runner.kv_pool
    layers = range(runner.model_config.num_layers)
    return [torch.cat([pool.k_buffer(i)[slots], pool.v_buffer(i)[slots]]) for i in layers]


def _ways(runner: ModelRunner, target: list[int]) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """The target's last logits row and its K/V, computed each way."""
    sb = StaticBatch(runner)
    g = torch.Generator().manual_seed(2)
    others = [torch.randint(10, runner.vocab_size, (n,), generator=g).tolist() for n in (3, 90, 17, 40)]
    out: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def done(name: str, seqs: list[Seq], logits: torch.Tensor, row: int = 0) -> None:
        out[name] = (logits[row].clone(), _kv(runner, seqs[row]))
        sb.release(seqs)

    seqs = sb.new(1)
    done("alone", seqs, sb.forward(seqs, [target]))

    seqs = sb.new(1 + len(others))
    done("beside others", seqs, sb.forward(seqs, [others[0], target, *others[1:]]), row=1)

    for cached in [c for c in (1, 16, 32, PROMPT + GENERATED - 1) if c % runner.page_size == 0]:
        src = sb.new(1)
        sb.forward(src, [target[:cached]])
        seqs = sb.new(1)
        sb.share_prefix(seqs[0], src[0], cached)
        logits = sb.forward(seqs, [target[cached:]])
        out[f"{cached} cached"] = (logits[0].clone(), _kv(runner, seqs[0]))
        sb.release(seqs, owned_from=[cached])
        sb.release(src)

    seqs = sb.new(1)
    for i in range(0, len(target), 7):
        logits = sb.forward(seqs, [target[i : i + 7]])
    done("chunks of 7", seqs, logits)

    # decoded: the generated tokens one at a time, beside other requests decoding too
    seqs = sb.new(3)
    sb.forward(seqs, [target[:PROMPT], others[1], others[3]])
    for t in target[PROMPT:]:
        logits = sb.forward(seqs, [[t], [11], [12]])
    done("decoded in a batch", seqs, logits)

    seqs = sb.new(1)
    sb.forward(seqs, [target[:PROMPT]])
    for t in target[PROMPT:]:
        logits = sb.forward(seqs, [[t]])
    done("decoded alone", seqs, logits)

    runner.kv_pool.check_integrity(in_use_pages=0)
    runner.req_to_token_pool.check_integrity(in_use=0)
    return out


def _differences(ways: dict[str, tuple[torch.Tensor, list[torch.Tensor]]]) -> list[str]:
    ref_logits, ref_kv = ways["alone"]
    bad = []
    for name, (logits, kv) in ways.items():
        if not torch.equal(logits, ref_logits):
            bad.append(f"{name}: logits")
        bad += [f"{name}: K/V of layer {i}" for i, (a, b) in enumerate(zip(kv, ref_kv)) if not torch.equal(a, b)]
    return bad


def _target(vocab: int) -> list[int]:
    return torch.randint(10, vocab, (PROMPT + GENERATED,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2"])
def test_every_way_of_computing_a_token_gives_the_same_bits(model_path, arch: str, dtype: str) -> None:
    runner = _runner(model_path(arch), dtype, deterministic=True)
    assert _differences(_ways(runner, _target(runner.vocab_size))) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_avx2_cpu_gives_the_same_bits(model_path, plan_env, dtype: str) -> None:
    """The plan of a CPU without AVX-512 (TANDEM_CPU_ISA=avx2): the AVX2 kernels, no oneDNN packing,
    torch's own bf16 matmul inside the tiles."""
    if "avx2" not in cpu_plan.levels_supported(cpu_plan.read_cpu_flags()):
        pytest.skip("this CPU does not execute AVX2")
    plan_env(TANDEM_CPU_ISA="avx2")
    assert cpu_plan.current().level == "avx2" and not cpu_plan.current().pack_bf16_linears
    runner = _runner(model_path("tiny"), dtype, deterministic=True)
    assert _differences(_ways(runner, _target(runner.vocab_size))) == []


def test_pages_of_16_give_the_same_bits(model_path) -> None:
    runner = _runner(model_path("tiny"), "bfloat16", deterministic=True, page_size=16)
    assert _differences(_ways(runner, _target(runner.vocab_size))) == []


def test_the_default_mode_fails_the_same_comparison(model_path) -> None:
    """The decode kernel sums in another order than the extend kernel: the test has teeth."""
    runner = _runner(model_path("tiny"), "bfloat16", deterministic=False)
    assert any(d.startswith("decoded") for d in _differences(_ways(runner, _target(runner.vocab_size))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(384, 256, generator=g) * 0.05).to(dtype)
    x = torch.randn(300, 256, generator=g).to(dtype)
    pack = can_pack_linears(torch.device("cpu"), dtype)
    for cols in (None, 100):  # whole, and in column blocks (the LM head's form)
        lin = InvariantLinear(w, None, rows=16, cols=cols, pack=pack)
        ref = lin(x)
        assert torch.allclose(ref.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
        for m in (1, 2, 3, 5, 8, 16, 17, 33, 100, 299):
            assert torch.equal(lin(x[:m]), ref[:m]), m
            assert torch.equal(lin(x[m:]), ref[m:]), m  # the same rows at other places in their tiles


def test_tiled_keeps_rows_and_accepts_strided_input() -> None:
    x = torch.randn(40, 24)[:, :16]  # not contiguous
    w = torch.randn(8, 16)
    assert torch.allclose(tiled([lambda t: F.linear(t, w)], x, 16), F.linear(x, w))
    assert tiled([lambda t: F.linear(t, w)], x[:0], 16).shape == (0, 8)


def test_refused_where_the_kernels_cannot_carry_it(model_path) -> None:
    with pytest.raises(ValueError, match="layer_ops=torch"):
        ModelRunner(model_path("tiny"), RunnerConfig(device="cpu", deterministic=True, layer_ops="torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_linear_rows_do_not_depend_on_the_thread_count(dtype) -> None:
    """PD roles and colocated workers may run other thread counts (tandem up pins one core each)."""
    g = torch.Generator().manual_seed(3)
    pack = can_pack_linears(torch.device("cpu"), dtype)
    threads = torch.get_num_threads()
    try:
        for n, k, cols in ((960, 576, None), (3072, 576, None), (576, 1536, None), (10000, 576, 4096)):
            lin = InvariantLinear((torch.randn(n, k, generator=g) * 0.05).to(dtype), None, 16, cols, pack)
            x = torch.randn(40, k, generator=g).to(dtype)
            torch.set_num_threads(2)
            two = lin(x)
            torch.set_num_threads(1)
            assert torch.equal(lin(x), two), (n, k)
    finally:
        torch.set_num_threads(threads)


def test_a_quoted_switch_is_refused_not_read_as_true() -> None:
    from tandem.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="deterministic must be true or false"):
        EngineConfig(deterministic="false")
    with pytest.raises(ValueError, match="disable_radix_cache must be true or false"):
        EngineConfig(disable_radix_cache=1)
