"""The fused CPU decoder-layer ops against the torch path they replace.

Each op must round where the torch chain rounds, so in bf16 the results are
bit-identical (same fp32 math, same rounding points); in fp32 they may differ
by the order of a reduction or an FMA, i.e. a few ulp.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from tandem.engine.kernels import cpu_kernels
from tandem.engine.models.layer_ops import TORCH, Heads
from tandem.engine.models.layers import RMSNorm
from tandem.engine.models.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("kernel_level")  # every kernel level this CPU executes
DTYPES = [torch.float32, torch.bfloat16]


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.bfloat16:
        assert torch.equal(a, b), f"{(a != b).sum().item()} of {a.numel()} differ"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    n = RMSNorm(dim, 1e-6).to(dtype)
    n.weight.data.normal_()
    return n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_rms_norm_and_fused_add(dtype, rows):
    torch.manual_seed(rows)
    norm = _norm(1024, dtype)
    x, res = (torch.randn(rows, 1024) * 3).to(dtype), torch.randn(rows, 1024).to(dtype)
    _same(cpu_kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
    want_res = res + x
    want = norm(want_res)
    cpu_kernels.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    _same(res, want_res)
    _same(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_rows(dtype):
    norm = _norm(256, dtype)
    wide = torch.randn(9, 512).to(dtype)
    _same(cpu_kernels.rms_norm(wide[:, 128:384], norm.weight, norm.eps), norm(wide[:, 128:384].contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(0)
    gu = (torch.randn(33, 2 * 2816) * 4).to(dtype)
    gu[0, :8] = torch.tensor([-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 3.0])
    gate, up = gu.split(2816, dim=-1)
    _same(cpu_kernels.silu_and_mul(gu), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(16, 4, 64), (8, 8, 128), (4, 2, 32)])
def test_rope_qk_matches_torch_path(dtype, qk_norm, heads):
    hq, hkv, dim = heads
    torch.manual_seed(hq)
    cfg = LlamaConfig(hidden_size=hq * dim, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=dim,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    rope = RotaryEmbedding(cfg, dim, 4096)
    positions = torch.randint(0, 4096, (37,))
    qkv = torch.randn(37, (hq + 2 * hkv) * dim).to(dtype)
    v = qkv[:, (hq + hkv) * dim :]
    qn, kn = (_norm(dim, dtype), _norm(dim, dtype)) if qk_norm else (None, None)
    want_q, want_k, _ = TORCH.qk_rope(qkv, TORCH.rope_batch(rope, positions, dtype), Heads(hq, hkv, dim),
                                      qn and qn.weight, kn and kn.weight, 1e-6)
    # the table as the model holds it: cast with the model (bf16) or fp32
    table = rope.to(dtype)
    got = qkv.clone()
    cpu_kernels.rope_qk(got, positions, table.cos, table.sin, qn and qn.weight, kn and kn.weight,
                        hq, hkv, dim, 1e-6)
    gq, gk, gv = got.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    _same(gq, want_q.flatten(1))
    _same(gk, want_k.flatten(1))
    assert torch.equal(gv, v), "v must be left alone"


def test_rope_rejects_positions_outside_the_table():
    rope = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=1, head_dim=64), 64, 16)
    qkv = torch.randn(2, 3 * 64)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_kernels.rope_qk(qkv, torch.tensor([3, 16]), rope.cos, rope.sin, None, None, 1, 1, 64, 1e-6)


def test_shape_checks():
    w = torch.ones(24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.rms_norm(torch.randn(2, 24), w, 1e-6)
    with pytest.raises(RuntimeError, match="gate_up"):
        cpu_kernels._ops().silu_and_mul(torch.empty(2, 32), torch.randn(2, 48))
