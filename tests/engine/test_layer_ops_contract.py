"""The layer-ops contract (engine/models/layer_ops.py) over every implementation.

Each implementation must be as close to an fp32 reference as the torch chain in the same
dtype is (the fused kernels round once where HF's chain rounds after every op, so they may
differ from it but never be worse), return what the contract says, and leave v alone.

    torch               the reference itself: its shapes and views
    cpu-kernels         the fused CPU ops, at the level this CPU runs
    flashinfer-standin  FlashInferLayerOps over tests/support/fake_flashinfer_ops.py, on CPU
    flashinfer          FlashInferLayerOps over the real kernels (gpu)

The last test runs whole models (Qwen3 with qk-norm, Llama, Qwen2) through FlashInferLayerOps
on the stand-in and holds their logits to HF fp32 as closely as the torch ops in bf16.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig

from tandem.engine.kernels import cpu_kernels
from tandem.engine.models import layer_ops, layer_ops_choice
from tandem.engine.models.layer_ops import TORCH, Heads, LayerOps
from tandem.engine.models.rotary import RotaryEmbedding

IMPLS = ["torch", "cpu-kernels", "flashinfer-standin", pytest.param("flashinfer", marks=pytest.mark.gpu)]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch) -> tuple[Callable[[RotaryEmbedding], LayerOps], str]:
    """(build the implementation for a model whose RoPE is the argument, its device)."""
    name = request.param
    device = "cpu"
    if name == "cpu-kernels":
        if not cpu_kernels.enabled("layer_ops"):
            pytest.skip("the CPU kernels are not built on this machine")
        return lambda rotary: layer_ops.CpuKernelOps(), device
    if name == "flashinfer-standin":
        import fake_flashinfer

        fake_flashinfer.install(monkeypatch)
    if name.startswith("flashinfer"):
        from tandem.engine.models.flashinfer_ops import FlashInferLayerOps

        return FlashInferLayerOps, "cuda" if name == "flashinfer" else device
    return lambda rotary: TORCH, device


def _dtypes(ops: LayerOps) -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16] if ops.name == "flashinfer" else [torch.float32, torch.bfloat16]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def _no_worse(got: torch.Tensor, reference: torch.Tensor, torch_chain: torch.Tensor) -> None:
    """got is as close to the fp32 reference as the torch chain in its dtype, give or take a few
    ulp (an fp32 kernel may order a reduction or an FMA differently)."""
    ulps = 4 * torch.finfo(got.dtype).eps * float(reference.abs().max())
    assert _err(got, reference) <= 1.5 * _err(torch_chain, reference) + ulps


def _rope(dim: int, max_pos: int = 4096) -> RotaryEmbedding:
    cfg = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    return RotaryEmbedding(cfg, dim, max_pos)


def test_norms_and_silu(impl) -> None:
    make, device = impl
    ops = make(_rope(64).to(device))
    for dtype in _dtypes(ops):
        torch.manual_seed(0)
        x32, r32 = torch.randn(37, 1024, device=device) * 3, torch.randn(37, 1024, device=device)
        w32 = torch.randn(1024, device=device)
        x, r, w = x32.to(dtype), r32.to(dtype), w32.to(dtype)
        ref = layer_ops.torch_rms_norm(x.float(), w.float(), 1e-6)
        _no_worse(ops.rms_norm(x, w, 1e-6), ref, TORCH.rms_norm(x, w, 1e-6))

        want_n, want_r = TORCH.add_rms_norm(x, r, w, 1e-6)
        ref_r = x.float() + r.float()
        got_n, got_r = ops.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
        _no_worse(got_r, ref_r, want_r)
        _no_worse(got_n, layer_ops.torch_rms_norm(ref_r, w.float(), 1e-6), want_n)

        gu = (torch.randn(33, 2 * 768, device=device) * 4).to(dtype)
        ref = TORCH.silu_and_mul(gu.float())
        got = ops.silu_and_mul(gu)
        assert got.shape == (33, 768) and got.dtype == dtype
        _no_worse(got, ref, TORCH.silu_and_mul(gu))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm+rope"])
@pytest.mark.parametrize("shape", [(16, 4, 64), (8, 8, 128), (16, 2, 256)])
def test_qk_rope(impl, qk_norm: bool, shape: tuple[int, int, int]) -> None:
    make, device = impl
    heads = Heads(*shape)
    rotary = _rope(heads.dim).to(device)
    for dtype in _dtypes(make(rotary)):
        torch.manual_seed(heads.q)
        qkv = torch.randn(29, (heads.q + 2 * heads.kv) * heads.dim, device=device).to(dtype)
        norms = [torch.randn(heads.dim, device=device).to(dtype) for _ in range(2)] if qk_norm else [None, None]
        positions = torch.randint(0, 4096, (29,), device=device)
        ref = TORCH.qk_rope(qkv.float(), TORCH.rope_batch(rotary, positions, torch.float32), heads,
                            *[None if n is None else n.float() for n in norms], 1e-6)
        # The model's tables are cast to its dtype at load, as HF casts its cos/sin.
        tables = copy.deepcopy(rotary).to(dtype)
        chain = TORCH.qk_rope(qkv, TORCH.rope_batch(tables, positions, dtype), heads, *norms, 1e-6)
        ops = make(tables)  # built for a model whose tables these are
        rows = qkv.clone()
        q, k, v = ops.qk_rope(rows, ops.rope_batch(tables, positions, dtype), heads, *norms, 1e-6)
        assert q.shape == (29, heads.q, heads.dim) and k.shape == v.shape == (29, heads.kv, heads.dim)
        assert q.dtype == k.dtype == v.dtype == dtype
        v_at = (heads.q + heads.kv) * heads.dim
        assert torch.equal(v.flatten(1), qkv[:, v_at:]), "v is left alone"
        assert v.data_ptr() == rows.data_ptr() + v_at * rows.element_size(), "v is a view of qkv"
        for got, want, c in zip((q, k), ref, chain):
            _no_worse(got, want, c)


@pytest.mark.parametrize("arch", ["tiny", "tiny-llama", "tiny-qwen2"])
def test_models_through_flashinfer_ops_are_as_close_to_hf_as_torch_ops(model_path, monkeypatch, arch: str) -> None:
    """bf16 on CPU: the same prompts and teacher-forced decode steps through the torch ops and
    through FlashInferLayerOps (stand-in kernels), each against HF fp32."""
    import fake_flashinfer
    from test_model_vs_hf import _hf_logits, _prompts, _rel, _runner

    from tandem.engine.runner.static_generate import StaticBatch

    fake_flashinfer.install(monkeypatch)
    path = model_path(arch)
    errors = {}
    for name in ("torch", "flashinfer"):
        runner = _runner(path, dtype="bfloat16", layer_ops="torch")
        runner.model.use_layer_ops(layer_ops_choice.build(name, runner.model))
        sb = StaticBatch(runner)
        prompts = _prompts(runner.vocab_size, [20, 45], seed=5)
        seqs = sb.new(len(prompts))
        steps = [sb.forward(seqs, prompts).clone()]
        cont = [[11 + 7 * t + i for t in range(6)] for i in range(len(prompts))]
        steps += [sb.forward(seqs, [[c[t]] for c in cont]).clone() for t in range(6)]
        errors[name] = max(
            _rel(torch.stack([s[i] for s in steps]), _hf_logits(path, p + c)[len(p) - 1 :])
            for i, (p, c) in enumerate(zip(prompts, cont))
        )
        sb.release(seqs)
        runner.kv_pool.check_integrity(in_use_pages=0)
    assert errors["flashinfer"] <= 1.5 * errors["torch"] + 1e-3, errors


def test_flashinfer_ops_that_cannot_run_here_fail_at_start_up(model_path, monkeypatch, caplog) -> None:
    """A kernel FlashInfer cannot build or launch (no nvcc for its JIT, say) fails the warm-up
    that `build` runs: `auto` keeps the torch ops, an explicit layer_ops=flashinfer is refused."""
    import fake_flashinfer
    from test_model_vs_hf import _runner

    flashinfer = fake_flashinfer.install(monkeypatch)
    runner = _runner(model_path("tiny-llama"), dtype="bfloat16", layer_ops="torch")
    assert layer_ops_choice.build("flashinfer", runner.model).name == "flashinfer"

    def no_compiler(*args, **kw):
        raise RuntimeError("Ninja build failed: nvcc not found")

    monkeypatch.setattr(flashinfer.activation, "silu_and_mul", no_compiler)
    assert layer_ops_choice.build("flashinfer", runner.model, fall_back=True) is TORCH
    assert "nvcc not found" in caplog.text
    with pytest.raises(ValueError, match="layer_ops=flashinfer cannot run here: RuntimeError: Ninja"):
        layer_ops_choice.build("flashinfer", runner.model)


def test_choose_takes_the_devices_fused_ops_and_refuses_what_cannot_run() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    assert layer_ops_choice.choose("auto", "cuda", bf16, 128, True, False) == "flashinfer"
    assert layer_ops_choice.choose("auto", "cuda", f32, 128, True, False) == "torch"  # no fp32 kernels
    assert layer_ops_choice.choose("auto", "cuda", bf16, 32, True, False) == "torch"  # head_dim 32
    assert layer_ops_choice.choose("auto", "cuda", bf16, 128, False, False) == "torch"  # not installed
    assert layer_ops_choice.choose("auto", "cpu", f32, 64, True, True) == "cpu-kernels"
    assert layer_ops_choice.choose("auto", "cpu", f32, 64, True, False) == "torch"
    assert layer_ops_choice.choose("torch", "cuda", bf16, 128, True, False) == "torch"
    for args in [("flashinfer", "cpu", bf16, 128, True, False), ("flashinfer", "cuda", f32, 128, True, False),
                 ("cpu-kernels", "cuda", bf16, 128, True, True), ("cpu-kernels", "cpu", f32, 64, True, False),
                 ("fused", "cpu", f32, 64, True, True)]:
        with pytest.raises(ValueError):
            layer_ops_choice.choose(*args)
