"""RoPE on q and k and the layer's K/V store in one kernel launch (Triton), on CUDA.

Unfused, a layer launches FlashInfer's RoPE (q and k in place) and then the K/V store
(kvcache/kv_store_triton.py), and k is read twice. Here program t handles token t:

    q[t, h] = rope(q[t, h], pos[t])                                     in place, every query head
    k[t, h] = rope(k[t, h], pos[t]);  k_buffer[loc[t], h] = k[t, h]     in place and into the pool
    v_buffer[loc[t]] = v[t]

RoPE is neox (rotate-half), read from the (positions, head_dim) fp32 [cos | sin] table that
FlashInferLayerOps builds, computed in fp32 and rounded once, with fused multiply-adds off: the
result is bit for bit "RoPE in fp32 from that table, rounded, then stored", the chain it replaces
(the FlashInfer stand-in's RoPE; FlashInfer's own kernel may contract a multiply-add, a difference
of one rounding at most). In fp32 that is the torch chain's result exactly. k is written back in
place as well as into the pool because the attention contract hands the forward's k to the backend
(the ragged prefill reads it there).

q, k and v may be strided views of the qkv rows, or (Qwen3, after its qk-norm) tensors of their
own; each head's head_dim values must be contiguous. The kernel reads and writes only the tensors
passed in and the launch allocates nothing, so it runs under CUDA-graph capture with the graph's
static positions and slots. Tested against the unfused chain through Triton's interpreter on CPU
and on the GPU (tests/engine/test_rope_kv_store.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the unfused ops serve
    triton = None

if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """fp32 x to `dtype`, to nearest even. For bf16 by hand, from the bits: Triton's interpreter
        truncates in its bf16 cast, and the CPU tests must see the GPU's rounding."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(x != x, 0x7FC0, bits)  # NaN stays a NaN
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _rope_store(q, k, v, q_row, q_head, k_row, k_head, v_row, v_head, pos, table, table_row, loc,  # noqa: N803
                    k_buf, v_buf, num_q, num_kv, HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_KV: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        row = table + tl.load(pos + t).to(tl.int64) * table_row
        d = tl.arange(0, HALF)[None, :]
        cos, sin = tl.load(row + d), tl.load(row + HALF + d)

        hq = tl.arange(0, BLOCK_Q)[:, None]
        at, keep = q + t * q_row + hq * q_head + d, hq < num_q
        x1, x2 = tl.load(at, mask=keep).to(tl.float32), tl.load(at + HALF, mask=keep).to(tl.float32)
        tl.store(at, _round(x1 * cos - x2 * sin, q.dtype.element_ty), mask=keep)
        tl.store(at + HALF, _round(x2 * cos + x1 * sin, q.dtype.element_ty), mask=keep)

        hk = tl.arange(0, BLOCK_KV)[:, None]
        keep = hk < num_kv
        slot = tl.load(loc + t).to(tl.int64) * num_kv * 2 * HALF + hk * 2 * HALF + d  # within a pool buffer
        at = k + t * k_row + hk * k_head + d
        x1, x2 = tl.load(at, mask=keep).to(tl.float32), tl.load(at + HALF, mask=keep).to(tl.float32)
        r1, r2 = _round(x1 * cos - x2 * sin, k.dtype.element_ty), _round(x2 * cos + x1 * sin, k.dtype.element_ty)
        tl.store(at, r1, mask=keep)
        tl.store(at + HALF, r2, mask=keep)
        tl.store(k_buf + slot, r1, mask=keep)
        tl.store(k_buf + slot + HALF, r2, mask=keep)

        at = v + t * v_row + hk * v_head + d
        tl.store(v_buf + slot, tl.load(at, mask=keep), mask=keep)
        tl.store(v_buf + slot + HALF, tl.load(at + HALF, mask=keep), mask=keep)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def supports(head_dim: int) -> bool:
    """The kernel indexes half a head as one power-of-two block: head dims 64, 128, 256 (FlashInfer's)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def _refuse_unless_it_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           loc: torch.Tensor) -> None:
    """What the kernel assumes and would otherwise misread silently."""
    n, _, dim = q.shape
    if not supports(dim) or k.shape[2] != dim or v.shape != k.shape or k.shape[0] != n:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: one head_dim of 64/128/256")
    if any(t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError("each head of q, k and v must be contiguous")
    if k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape != k_buffer.shape or not (
            k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("the pool buffers must be contiguous (slots, kv_heads, head_dim) of k's heads")
    if len({q.dtype, k.dtype, v.dtype, k_buffer.dtype, v_buffer.dtype}) != 1:
        raise ValueError("q, k, v and the pool must share one dtype (the store does not convert)")
    if cos_sin.dtype != torch.float32 or cos_sin.shape[1] != dim or cos_sin.stride(1) != 1:
        raise ValueError("cos_sin must be the fp32 (positions, head_dim) [cos | sin] table")
    if positions.shape != (n,) or loc.shape != (n,) or not (positions.is_contiguous() and loc.is_contiguous()):
        raise ValueError("positions and loc must be contiguous, one per token")
    if {positions.dtype, loc.dtype} - {torch.int32, torch.int64}:
        raise ValueError("positions and loc must be int32 or int64")


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor) -> None:
    """RoPE on q (tokens, q_heads, head_dim) and k (tokens, kv_heads, head_dim) in place, then
    k_buffer[loc] = k and v_buffer[loc] = v, in one launch."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    _refuse_unless_it_fits(q, k, v, positions, cos_sin, k_buffer, v_buffer, loc)
    n, num_q, dim = q.shape
    if n == 0:
        return
    num_kv = k.shape[1]
    _rope_store[(n,)](q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      positions, cos_sin, cos_sin.stride(0), loc, k_buffer, v_buffer, num_q, num_kv,
                      HALF=dim // 2, BLOCK_Q=triton.next_power_of_2(num_q), BLOCK_KV=triton.next_power_of_2(num_kv),
                      enable_fp_fusion=False)
