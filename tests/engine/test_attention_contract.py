"""One contract test for every attention backend (see engine/attention/base.py).

Each case places random K/V for cached prefixes in the paged pool, runs the
backend on a batch of new tokens, and compares with dense causal attention
computed from the full K/V sequences.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.engine.attention import create_backend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.model_config import RunnerConfig

HEADS, KV_HEADS, DIM = 8, 2, 64  # a head_dim every backend runs (FlashInfer has no 32)

BACKENDS = [
    pytest.param("torch", "cpu", id="torch-cpu"),  # the fused paged kernels where they build
    pytest.param("torch-sdpa", "cpu", id="torch-cpu-sdpa"),  # the same backend, kernels off
    pytest.param("torch-deterministic", "cpu", id="torch-cpu-deterministic"),  # every row through the extend kernel
    pytest.param("flashinfer", "cuda", id="flashinfer-cuda", marks=pytest.mark.gpu),
    pytest.param("torch", "cuda", id="torch-cuda-sdpa", marks=pytest.mark.gpu),  # what fp32 on CUDA runs
    # The FlashInfer backend's page tables and plans on CPU, over a stand-in for its kernels.
    pytest.param("flashinfer-fake", "cpu", id="flashinfer-backend-cpu-standin"),
]

# (prefix_len, extend_len) per request; one case per mode the contract names
CASES = {
    "extend-no-prefix": (ForwardMode.EXTEND, [(0, 7), (0, 19)]),
    "extend-partial-page": (ForwardMode.EXTEND, [(5, 9), (3, 1), (0, 4)]),
    "extend-several-pages": (ForwardMode.EXTEND, [(40, 13), (17, 30)]),
    "decode": (ForwardMode.DECODE, [(1, 1), (15, 1), (16, 1), (70, 1)]),
    "mixed": (ForwardMode.MIXED, [(9, 6), (0, 11), (33, 1), (4, 1)]),
}


def mode_kind(mode: ForwardMode) -> str:
    """The stand-in's plan kind for a batch with a cached prefix somewhere."""
    return "decode" if mode == ForwardMode.DECODE else "prefill"


def _ctx(device: str, page_size: int, dtype: torch.dtype, deterministic: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(8, 256, device),
        kv_pool=TokenToKVPool(512 // page_size + 1, page_size, 1, KV_HEADS, DIM, dtype, device),
        device=torch.device(device), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
        scaling=DIM**-0.5, dtype=dtype, page_size=page_size, config=RunnerConfig(deterministic=deterministic),
    )


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """q (n, H, D) at positions prefix.., k/v (prefix+n, Hkv, D) -> (n, H*D)."""
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * DIM**-0.5
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (prefix + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1)


@pytest.mark.parametrize("name,device", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_stored", [False, True], ids=["backend-stores", "caller-stored"])
def test_attention_contract(name: str, device: str, page_size: int, case: str, kv_stored: bool, monkeypatch) -> None:
    """kv_stored: the k/v are in the pool already (a layer op that fuses RoPE with the store wrote
    them): the backend reads them and must not store again."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.float32 if device == "cpu" and name != "flashinfer-fake" else torch.bfloat16
    torch.manual_seed(0)
    mode, reqs = CASES[case]
    ctx = _ctx(device, page_size, dtype, deterministic=name.endswith("-deterministic"))
    if name == "flashinfer-fake":
        import fake_flashinfer

        from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        fake_flashinfer.install(monkeypatch)
        backend = FlashInferAttentionBackend(ctx)
    else:
        backend = create_backend(name.removesuffix("-sdpa").removesuffix("-deterministic"), ctx)
    if name.endswith("-sdpa"):
        backend.use_extend_kernel = backend.use_decode_kernel = False
    alloc = ctx.kv_pool.allocator
    rows = ctx.req_to_token_pool.alloc(len(reqs))
    full_k, full_v, new_locs = [], [], []
    for row, (prefix, extend) in zip(rows, reqs):
        slots = alloc.alloc(prefix + extend)
        ctx.req_to_token_pool.write(row, 0, slots)
        k = torch.randn(prefix + extend, KV_HEADS, DIM, dtype=dtype, device=device)
        v = torch.randn_like(k)
        ctx.kv_pool.set_kv(0, slots[:prefix].to(device), k[:prefix], v[:prefix])
        full_k.append(k)
        full_v.append(v)
        new_locs.append(slots[prefix:])
    n_tok = sum(e for _, e in reqs)
    # q too: a strided view of rows wider than it (the model's qkv)
    q = torch.randn(n_tok, (HEADS + 2) * DIM, dtype=dtype, device=device)[:, : HEADS * DIM].view(n_tok, HEADS, DIM)
    # k and v as the model hands them over: strided views of one row per token (its qkv)
    kv_rows = torch.cat([torch.cat([k[p:], v[p:]], dim=1) for k, v, (p, _) in zip(full_k, full_v, reqs)])
    k_new, v_new = kv_rows[:, :KV_HEADS], kv_rows[:, KV_HEADS:]
    n_extend = sum(1 for _, e in reqs if mode != ForwardMode.MIXED or e > 1)
    batch = ForwardBatch.build(
        mode, torch.zeros(n_tok, dtype=torch.int64), rows, [p for p, _ in reqs], [e for _, e in reqs],
        torch.cat(new_locs), device, num_extend_reqs=None if mode != ForwardMode.MIXED else n_extend,
    )
    backend.init_forward_metadata(batch)
    if name == "flashinfer-fake":  # planned from host lengths: reading them costs no device sync
        assert fake_flashinfer.PLANS and all(p.host_indptr for p in fake_flashinfer.PLANS)
        # No cached prefix anywhere in the batch: the ragged kernel, over the forward's own k/v.
        ragged = mode == ForwardMode.EXTEND and all(p == 0 for p, _ in reqs)
        assert {p.kind for p in fake_flashinfer.PLANS} == {"ragged" if ragged else mode_kind(mode)}
    if kv_stored:
        ctx.kv_pool.set_kv(0, batch.out_cache_loc, k_new, v_new)
        monkeypatch.setattr(ctx.kv_pool, "set_kv", lambda *a: pytest.fail("stored twice"))
    out = backend.forward(q, k_new, v_new, 0, batch, kv_stored=kv_stored)
    assert out.shape == (n_tok, HEADS * DIM) and out.dtype == dtype

    start = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for (prefix, extend), k, v in zip(reqs, full_k, full_v):
        ref = _dense(q[start : start + extend], k, v, prefix)
        torch.testing.assert_close(out[start : start + extend].float(), ref, atol=tol, rtol=tol)
        start += extend
    # The side effect: this batch's K/V now sit in the pool at out_cache_loc.
    loc = batch.out_cache_loc
    torch.testing.assert_close(ctx.kv_pool.k_buffer(0)[loc], k_new.to(dtype))
    torch.testing.assert_close(ctx.kv_pool.v_buffer(0)[loc], v_new.to(dtype))
    alloc.check_integrity(in_use_pages=sum(-(-(p + e) // page_size) for p, e in reqs))
