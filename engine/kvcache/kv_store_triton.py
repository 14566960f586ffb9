"""A layer's K and V written into the pool in one kernel launch (Triton), on CUDA.

The torch path is two `index_copy_` launches a layer (K, then V). At decode batch 1 on an H200
each moves a few hundred bytes and costs its launch: 32 of a replay's ~300 kernels for the
Llama-1B shape (docs/gpu.md). Here program t copies token t's K row and V row:

    k_buffer[loc[t]] = k[t];  v_buffer[loc[t]] = v[t]        (each row: kv_heads * head_dim values)

k and v may be strided views of the forward's qkv rows (their row stride is qkv's width); a
row's kv_heads * head_dim values must be contiguous, as they are there. Tested against
`index_copy_` on CPU through Triton's interpreter and on the GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: index_copy_ serves
    triton = None

if triton is not None:

    @triton.jit
    def _store(k, v, k_stride, v_stride, loc, k_buf, v_buf, width, BLOCK: tl.constexpr):  # noqa: N803
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(loc + t)
        for off in range(0, width, BLOCK):
            j = off + tl.arange(0, BLOCK)
            keep = j < width
            tl.store(k_buf + slot * width + j, tl.load(k + t * k_stride + j, mask=keep), mask=keep)
            tl.store(v_buf + slot * width + j, tl.load(v + t * v_stride + j, mask=keep), mask=keep)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def rows_are_dense(x: torch.Tensor) -> bool:
    """x (tokens, kv_heads, head_dim): each token's values contiguous, whatever the row stride."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_buffer[loc] = k, v_buffer[loc] = v: contiguous (slots, kv_heads, head_dim) buffers,
    (tokens, kv_heads, head_dim) k/v of their dtype with dense rows, int64 loc on their device."""
    assert triton is not None, "Triton is not installed"  # invariant: chosen only when Triton imports
    tokens = loc.numel()
    if tokens == 0:
        return
    width = k.shape[1] * k.shape[2]
    block = min(triton.next_power_of_2(width), 1024)
    _store[(tokens,)](k, v, k.stride(0), v.stride(0), loc, k_buffer, v_buffer, width, BLOCK=block)
