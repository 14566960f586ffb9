"""The fused CPU paged decode and extend kernels against dense attention.

K/V rows sit at random slots of a pool (random req_to_token rows, i.e. pages
scattered anywhere), the kernels read them through req_to_token, and the result
must match softmax(q k^T * scale) v over each request's first seq_len slots
(causal over prefix + new tokens for extend), at every kernel level.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.model_config import RunnerConfig

# Every test runs once per kernel level this CPU executes (conftest.kernel_level): the
# AVX-512, AVX2 and plain-lane forms must each match the dense reference.
pytestmark = pytest.mark.usefixtures("kernel_level")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _dense(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, scale):
    """q (B, Hq, D) -> (B, Hq, D) fp32, one request at a time from its gathered K/V."""
    group = q.shape[1] // k_buffer.shape[1]
    out = []
    for b in range(q.shape[0]):
        slots = req_to_token[rows[b], : seq_lens[b]].long()
        k = k_buffer[slots].float().repeat_interleave(group, 1)  # (seq, Hq, D)
        v = v_buffer[slots].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[b].float(), k) * scale
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
    return torch.stack(out)


def _case(batch, heads, kv_heads, dim, dtype, seq_lens, max_ctx=600, num_slots=8192):
    k_buffer = torch.randn(num_slots, kv_heads, dim).to(dtype)  # (slots, kv_heads, dim)
    v_buffer = torch.randn(num_slots, kv_heads, dim).to(dtype)
    num_rows = batch + 3
    # every row a random permutation of slots: positions land on arbitrary pages
    req_to_token = torch.stack([torch.randperm(num_slots - 1)[:max_ctx] + 1 for _ in range(num_rows)])
    req_to_token = req_to_token.to(torch.int32)  # (rows, max_ctx)
    rows = torch.randperm(num_rows)[:batch].to(torch.int64)
    q = torch.randn(batch, heads, dim).to(dtype)
    return q, k_buffer, v_buffer, req_to_token, rows, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 4), (16, 2)], ids=["g1", "g4", "g8"])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_decode_matches_dense(dtype, dim, heads, kv_heads, batch):
    torch.manual_seed(batch * 1000 + dim + heads + kv_heads)
    lens = [1, 2, 31, 32, 33, 257, 600][:batch] + torch.randint(1, 600, (max(0, batch - 7),)).tolist()
    q, kb, vb, r2t, rows, seq_lens = _case(batch, heads, kv_heads, dim, dtype, lens)
    scale = dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, kb, vb, r2t, rows, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _dense(q, kb, vb, r2t, rows, seq_lens, scale)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(64, 8, 128), (32, 4, 256)], ids=["h64d128", "h32d256"])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_many_heads_split_into_kv_head_chunks(dtype, heads, kv_heads, dim, num_splits):
    """More query heads than one item's accumulators hold: items cover kv-head chunks."""
    torch.manual_seed(heads + dim + num_splits)
    q, kb, vb, r2t, rows, seq_lens = _case(3, heads, kv_heads, dim, dtype, [5, 300, 77])
    out = cpu_kernels.paged_decode_attention(q, kb, vb, r2t, rows, seq_lens, 0.1, num_splits=num_splits)
    ref = _dense(q, kb, vb, r2t, rows, seq_lens, 0.1)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_split_sequences_merge_exactly(dtype, num_splits):
    """Cutting sequences into splits (then merging) gives the unsplit answer."""
    torch.manual_seed(num_splits)
    q, kb, vb, r2t, rows, seq_lens = _case(4, 16, 4, 64, dtype, [1, 40, 300, 600])
    ref = _dense(q, kb, vb, r2t, rows, seq_lens, 0.125)
    out = cpu_kernels.paged_decode_attention(q, kb, vb, r2t, rows, seq_lens, 0.125, num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_strided_q_and_out():
    """q may be a view into a fused qkv projection; out may be a slice of a bigger buffer."""
    torch.manual_seed(0)
    q, kb, vb, r2t, rows, seq_lens = _case(3, 16, 4, 64, torch.float32, [5, 100, 17])
    qkv = torch.randn(3, 24, 64)
    qkv[:, :16] = q
    big = torch.zeros(3, 32, 64)
    out = cpu_kernels.paged_decode_attention(
        qkv[:, :16], kb, vb, r2t, rows, seq_lens, 0.125, out=big[:, 8:24]
    )
    torch.testing.assert_close(out, _dense(q, kb, vb, r2t, rows, seq_lens, 0.125), atol=1e-5, rtol=1e-5)
    assert big[:, :8].abs().sum() == 0 and big[:, 24:].abs().sum() == 0


def test_large_scores_are_stable():
    """Online softmax keeps a running max: huge logits must not overflow."""
    torch.manual_seed(1)
    q, kb, vb, r2t, rows, seq_lens = _case(2, 8, 2, 64, torch.float32, [200, 77])
    q = q * 100.0
    out = cpu_kernels.paged_decode_attention(q, kb, vb, r2t, rows, seq_lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _dense(q, kb, vb, r2t, rows, seq_lens, 1.0), atol=1e-4, rtol=1e-4)


# Each call must be refused by a check before the kernel reads a pointer. Once the head_dim-48
# call reached a kernel built for another head_dim and segfaulted a whole test run (an AMX Xeon),
# so they run in a child process: a crash fails this test, naming the level, and nothing else.
_BAD_CALLS = r"""
import sys, torch
from tandem.engine.kernels import cpu_kernels as ck
def case(dim=64, heads=8, kv_heads=2, dtype=torch.float32, lens=(3, 4)):
    kb, vb = torch.randn(64, kv_heads, dim).to(dtype), torch.randn(64, kv_heads, dim).to(dtype)
    r2t = torch.arange(1, 33, dtype=torch.int32).repeat(4, 1)
    q, rows = torch.randn(len(lens), heads, dim).to(dtype), torch.tensor([1, 2])
    return q, kb, vb, r2t, rows, torch.tensor(lens, dtype=torch.int32)
def extend(q, kb, vb, r2t, rows, lens):
    two, starts = torch.tensor([2, 2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    return ck.paged_extend_attention(q.repeat(2, 1, 1), kb, vb, r2t, rows, two, two, starts, 1.0)
def cut(t):
    return t[..., :48].contiguous()
q, kb, vb, r2t, rows, lens = case()
long, bad_row = torch.tensor([3, 10_000], dtype=torch.int32), torch.tensor([1, 99])
calls = {
    "dtype": lambda: ck.paged_decode_attention(q.bfloat16(), kb, vb, r2t, rows, lens, 1.0),
    "seq_lens out of range": lambda: ck.paged_decode_attention(q, kb, vb, r2t, rows, long, 1.0),
    "req_pool_indices out of range": lambda: ck.paged_decode_attention(q, kb, vb, r2t, bad_row, lens, 1.0),
    "head_dim": lambda: ck.paged_decode_attention(cut(q), cut(kb), cut(vb), r2t, rows, lens, 1.0),
    "head_dim ": lambda: extend(cut(q), cut(kb), cut(vb), r2t, rows, lens),
    "kv_heads": lambda: ck.paged_decode_attention(*case(heads=64, kv_heads=2), 1.0),
}
with ck.forced(sys.argv[1]):
    for expect, call in calls.items():
        try:
            call()
            print("ACCEPTED", expect)
        except RuntimeError as e:
            print("refused" if expect.strip() in str(e) else "WRONG ERROR " + str(e).splitlines()[0], expect)
"""


def test_bad_input_is_refused_before_any_memory_is_read(tmp_path):
    import subprocess
    import sys

    level = cpu_kernels.active_level()
    run = subprocess.run([sys.executable, "-c", _BAD_CALLS, level], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"{level} kernels crashed on bad input (rc {run.returncode}):\n{run.stderr[-2000:]}"
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 6 and all(ln.startswith("refused") for ln in lines), run.stdout


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_kernel_matches_gather_path(page_size):
    """TorchAttentionBackend with the kernel equals its gather+SDPA path on a bf16 MIXED batch,
    and builds no padded gather index."""
    from types import SimpleNamespace

    from tandem.engine.attention.torch_backend import TorchAttentionBackend
    from tandem.engine.forward_batch import ForwardBatch, ForwardMode
    from tandem.engine.kvcache.memory_pool import TokenToKVPool
    from tandem.engine.kvcache.req_table import ReqToTokenPool

    torch.manual_seed(page_size)
    heads, kv_heads, dim, dtype = 16, 4, 64, torch.bfloat16
    # (prefix, extend): two extend requests (a prefix of a partial page, none), then decodes
    reqs = [(20, 5), (0, 37), (3, 1), (130, 1), (0, 1), (64, 1)]
    ctx = SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(8, 512, "cpu"),
        kv_pool=TokenToKVPool(1024 // page_size + 1, page_size, 2, kv_heads, dim, dtype, "cpu"),
        device=torch.device("cpu"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        scaling=dim**-0.5,
        dtype=dtype,
        page_size=page_size,
        config=RunnerConfig(),
    )
    fused, gather = TorchAttentionBackend(ctx), TorchAttentionBackend(ctx)
    assert fused.use_extend_kernel and fused.use_decode_kernel
    gather.use_extend_kernel = gather.use_decode_kernel = False
    rows = ctx.req_to_token_pool.alloc(len(reqs))
    new_locs = []
    for row, (prefix, extend) in zip(rows, reqs, strict=True):
        slots = ctx.kv_pool.allocator.alloc(prefix + extend)
        ctx.req_to_token_pool.write(row, 0, slots)
        for layer in range(2):
            k = torch.randn(prefix, kv_heads, dim, dtype=dtype)
            ctx.kv_pool.set_kv(layer, slots[:prefix], k, torch.randn_like(k))
        new_locs.append(slots[prefix:])
    n_tok = sum(e for _, e in reqs)
    batch = ForwardBatch.build(
        ForwardMode.MIXED, torch.zeros(n_tok, dtype=torch.int64), rows, [p for p, _ in reqs],
        [e for _, e in reqs], torch.cat(new_locs), "cpu", num_extend_reqs=2,
    )  # fmt: skip
    q = torch.randn(n_tok, heads, dim, dtype=dtype)
    k_new = torch.randn(n_tok, kv_heads, dim, dtype=dtype)
    v_new = torch.randn_like(k_new)
    for layer in range(2):
        outs = []
        for backend in (fused, gather):
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, k_new, v_new, layer, batch))
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)
    fused.init_forward_metadata(batch)
    assert batch.attn_metadata.decode_index is None and batch.attn_metadata.decode_mask is None


def _dense_extend(q, k_buffer, v_buffer, req_to_token, rows, prefixes, extends, starts, scale):
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, (p, n, s) in enumerate(zip(prefixes, extends, starts, strict=True)):
        slots = req_to_token[rows[b], : p + n].long()
        group = q.shape[1] // k_buffer.shape[1]
        k = k_buffer[slots].float().repeat_interleave(group, 1)  # (p + n, Hq, D)
        v = v_buffer[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,khd->htk", q[s : s + n].float(), k) * scale
        future = torch.arange(p + n)[None, :] > torch.arange(p, p + n)[:, None]  # (n, p + n)
        out[s : s + n] = torch.einsum("htk,khd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)
    return out


@pytest.mark.parametrize(
    "dtype,use_amx", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32", "bf16-fma", "bf16-amx"],
)
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(4, 2, 64), (16, 4, 64), (8, 8, 128), (12, 4, 32), (7, 1, 96), (32, 2, 256)]
)
def test_extend_kernel_matches_dense(dtype, use_amx, heads, kv_heads, dim):
    """Every extend request of a batch in one call: no prefix, prefixes of partial and several
    blocks, one new token, spans longer than one work item (> 256 new tokens). bf16 runs both
    product forms (AMX tiles where the CPU has them, else that case runs the FMA path too)."""
    torch.manual_seed(dim + heads)
    prefixes, extends = [0, 5, 33, 100, 0, 17], [1, 40, 7, 3, 300, 64]
    num_slots, rows = 4096, torch.arange(1, len(prefixes) + 1)
    k_buffer = torch.randn(num_slots, kv_heads, dim).to(dtype)
    v_buffer = torch.randn(num_slots, kv_heads, dim).to(dtype)
    req_to_token = torch.stack([torch.randperm(num_slots - 1)[:512] + 1 for _ in range(len(prefixes) + 2)]).int()
    starts = [sum(extends[:b]) + 2 for b in range(len(extends))]  # rows 0-1 of q belong to no request
    q = torch.randn(sum(extends) + 2, heads, dim).to(dtype)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    out = cpu_kernels.paged_extend_attention(
        q, k_buffer, v_buffer, req_to_token, rows, i32(prefixes), i32(extends), i32(starts), dim**-0.5, use_amx
    )
    want = _dense_extend(q, k_buffer, v_buffer, req_to_token, rows, prefixes, extends, starts, dim**-0.5)
    torch.testing.assert_close(out[2:].float(), want[2:], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy(dtype):
    """TokenToKVPool.set_kv through the fused op equals its index_copy_ path, with k/v as
    strided views of a fused qkv projection (as the model passes them)."""
    from tandem.engine.kvcache.memory_pool import TokenToKVPool

    torch.manual_seed(0)
    fused, plain = (TokenToKVPool(9, 16, 2, 4, 64, dtype, "cpu") for _ in range(2))
    assert fused._store is cpu_kernels.store_kv
    plain._store = None
    for pool in (fused, plain):
        pool.kv_buffer.zero_()  # torch.empty: compare written slots only against zeros elsewhere
    for tokens in (1, 64, 120):  # one decode token, a decode batch, a prefill chunk
        qkv = torch.randn(tokens, (16 + 2 * 4) * 64).to(dtype)
        k = qkv[:, 16 * 64 : 20 * 64].view(tokens, 4, 64)
        v = qkv[:, 20 * 64 :].view(tokens, 4, 64)
        loc = torch.randperm(9 * 16 - 16)[:tokens] + 16
        for pool in (fused, plain):
            pool.set_kv(1, loc, k, v)
        assert torch.equal(fused.kv_buffer, plain.kv_buffer)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.store_kv(fused.k_buffer(0), fused.v_buffer(0), torch.tensor([10**6]), k[:1], v[:1])
