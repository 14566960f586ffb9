"""The experts' MLPs on CUDA as a fused grouped GEMM (Triton), the kernel SGLang and vLLM call
fused_moe, written from its idea.

The pairs, sorted by expert, are cut into blocks of BLOCK_M rows that each belong to one
expert (a group's last block padded with a sentinel). Program (b, n) multiplies block b's rows
by its expert's weight, tile n of the output features, reading each row straight from the
input by its pair's index (x[pair // top_k] for gate/up, h[pair] for down) and writing it to
the pair's own output row. So there is no gathered copy of the input, and no host sync: the
block table is built by torch ops on the device, sized by a bound the host knows
(ceil(S / BLOCK_M) + experts blocks), so a CUDA graph could capture it.

    blocks    (B,) the block's held expert, -1 for blocks past the last group
    rows      (B * BLOCK_M,) the pair each block row computes, S (none) for padding

Tested against expert_mlp's torch forms on CPU through Triton's interpreter
(tests/engine/test_expert_mlp.py) and, where a GPU is lent, on the GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: expert_mlp's torch forms serve
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests
BLOCK_M = 16  # a decode step's experts get a token or two each: small blocks waste little

if triton is not None:

    @triton.jit
    def _gemm(a, w, c, rows, blocks, num_pairs, n_out, n_in, row_div,  # noqa: N803
              stride_am, stride_we, stride_wn, stride_wk, stride_cm,
              IEEE: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        expert = tl.load(blocks + b)
        if expert >= 0:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows + m)
            real = pair < num_pairs
            a_row = (pair // row_div).to(tl.int64)
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, n_in, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                at = tl.load(a + a_row[:, None] * stride_am + k[None, :],
                             mask=real[:, None] & (k[None, :] < n_in), other=0.0)
                wt = tl.load(w + expert.to(tl.int64) * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk,
                             mask=(n[None, :] < n_out) & (k[:, None] < n_in), other=0.0)
                if UPCAST:  # Triton's interpreter multiplies a bf16 tile's raw bits in tl.dot
                    acc += tl.dot(at.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
                elif IEEE:  # fp32 weights: no TF32, so fp32 stays exact against the torch forms
                    acc += tl.dot(at, wt, input_precision="ieee")
                else:
                    acc += tl.dot(at, wt)
            tl.store(c + pair.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(c.dtype.element_ty),
                     mask=real[:, None] & (n[None, :] < n_out))


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def block_table(order: torch.Tensor, offsets: torch.Tensor,
                block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, rows) for pairs sorted by held expert (`order`) with cumulative counts `offsets`."""
    num_pairs, held, dev = len(order), len(offsets), order.device
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    num_blocks = -(-num_pairs // block_m) + held  # each group wastes under one block
    slot = torch.arange(num_blocks * block_m, device=dev)
    expert = torch.searchsorted(pad_end, slot, right=True)  # the group a padded slot falls in
    live = expert < held
    e = expert.clamp(max=held - 1)
    within = slot - (pad_end[e] - padded[e])
    real = live & (within < counts[e])
    sorted_pos = (offsets.long()[e] - counts[e] + within).clamp(0, max(num_pairs - 1, 0))
    rows = torch.where(real, order[sorted_pos] if num_pairs else slot, num_pairs).to(torch.int32)
    blocks = torch.where(live[::block_m], e[::block_m], -1).to(torch.int32)
    return blocks, rows


def expert_mlp(x: torch.Tensor, top_k: int, order: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, silu_mul) -> torch.Tensor:
    """expert_mlp.run's contract, in two launches of the kernel with SiLU*mul between."""
    num_pairs = len(order)
    blocks, rows = block_table(order, offsets)
    h = torch.zeros(num_pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, gate_up, h, rows, blocks, num_pairs, top_k)
    h = silu_mul(h)
    out = torch.zeros(num_pairs, down.shape[1], dtype=x.dtype, device=x.device)
    _launch(h, down, out, rows, blocks, num_pairs, 1)
    return out


def _launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor,
            num_pairs: int, row_div: int) -> None:
    """c[pair] = w[expert] @ a[pair // row_div] for every real row of every live block."""
    n_out, n_in = w.shape[1], w.shape[2]
    if a.stride(1) != 1:
        a = a.contiguous()
    block_n = 64 if n_out >= 64 else 16
    block_k = 64 if n_in >= 64 else 16
    grid = (len(blocks), triton.cdiv(n_out, block_n))
    _gemm[grid](a, w, c, rows, blocks, num_pairs, n_out, n_in, row_div,
                a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
                IEEE=w.dtype == torch.float32, UPCAST=_INTERPRETED and w.dtype != torch.float32,
                BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
