"""The experts' SwiGLU MLPs over a batch's (token, expert) pairs: one seam, four ways to run it.

    pairs     S = T * top_k, pair p is token p // top_k's (p % top_k)-th expert
    order     (S,) the pairs sorted by held expert; a rank's other experts' pairs sort last
    offsets   (held,) int32, cumulative pair counts of the held experts, in that order

    out[p] = down[e] @ silu(gate[e] @ x[p // top_k]) * (up[e] @ x[p // top_k])   for p held here
    out[p] = 0                                                                     otherwise

Each is a grouped GEMM: every expert multiplies exactly its pairs' rows, and nothing loops
over tokens. Which runs is `choose`'s decision, by device and batch shape:

- `grouped` (torch._grouped_mm, one call a projection): no host sync and one dispatch for
  every expert. On CPU at 16 tokens over 32 experts a block took 4 ms against 6-7 ms for the
  per-expert loop; it serves between the CPU kernel's range and the loop's, and where the
  kernels are not built.
- `per_expert`: one oneDNN matmul pair per expert that has pairs, rows padded to oneDNN's
  buckets. Its Python cost per expert is paid back once experts get many rows each (prefill:
  at 2048 tokens, 56 ms against 70 ms for the grouped call, whose CPU kernel is plainer).
- `cpu_kernel` (kernels/csrc/expert_gemm_cpu.cpp): the same contract in one parallel pass that
  streams each reached expert's weight once, every row routed to it multiplied while the weight
  row is in cache: 23-29 GB/s of the machine's 32 at 1-16 tokens, 2.3-4x the grouped call
  (bench/moe_block_cpu.py). It is what a CPU decode step runs where the kernels are built;
  the torch forms serve where they are not, and past ~8 rows an expert.
- `triton` (models/moe_triton.py): the fused CUDA kernel, no host sync either.

All four are checked against one reference in tests/engine/test_expert_mlp.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.engine.models.layers import bucketed

SiluMul = Callable[[torch.Tensor], torch.Tensor]

# Mean pairs a held expert from which the per-expert loop beats the grouped call on CPU
# (bench/moe_block_cpu.py: equal near 32 at bf16 and fp32, the loop ahead above).
PER_EXPERT_MIN_ROWS = 32
# Mean pairs a held expert up to which the CPU kernel (a stream of dot products, not a blocked
# GEMM) beats the grouped call: 3x at 2 rows, equal at 8, half its speed at 32.
CPU_KERNEL_MAX_ROWS = 8

_HAS_GROUPED = hasattr(torch, "_grouped_mm")


def choose(device: torch.device, dtype: torch.dtype, num_pairs: int, held: int, hidden: int, width: int) -> str:
    """Which implementation runs a batch of `num_pairs` pairs over `held` experts of `width`."""
    if device.type == "cuda":
        from tandem.engine.models import moe_triton

        return "triton" if moe_triton.available(device) else "per_expert"
    if num_pairs >= PER_EXPERT_MIN_ROWS * held:
        return "per_expert"
    if num_pairs <= CPU_KERNEL_MAX_ROWS * held and _cpu_kernel(dtype, hidden, width):
        return "cpu_kernel"
    return "grouped" if _HAS_GROUPED else "per_expert"


def _cpu_kernel(dtype: torch.dtype, hidden: int, width: int) -> bool:
    from tandem.engine.kernels import cpu_kernels

    return (cpu_kernels.enabled("experts") and dtype in cpu_kernels.SUPPORTED_DTYPES
            and hidden % 16 == 0 and width % 16 == 0)


def run(how: str, x: torch.Tensor, top_k: int, order: torch.Tensor, offsets: torch.Tensor,
        gate_up: torch.Tensor, down: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
    """(S, H): each pair's expert output, unweighted; zero for pairs of experts not held here.
    `gate_up` is (held, 2I, H) ([gate; up] rows) and `down` (held, H, I), as stored."""
    return _IMPLS[how](x, top_k, order, offsets, gate_up, down, silu_mul)


def _grouped(x, top_k, order, offsets, gate_up, down, silu_mul) -> torch.Tensor:
    xs = x[order // top_k]
    h = silu_mul(torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets))
    ys = torch._grouped_mm(h, down.transpose(1, 2), offs=offsets)
    # rows past offsets[-1] (other ranks' experts) are left unwritten by the kernel
    held = torch.arange(len(order), device=x.device) < offsets[-1]
    return _unsort(torch.where(held[:, None], ys, 0), order)


def _per_expert(x, top_k, order, offsets, gate_up, down, silu_mul) -> torch.Tensor:
    xs = x[order // top_k]
    ys = torch.zeros_like(xs)
    # oneDNN (CPU bf16) builds a kernel per row count: pad each group to its row bucket.
    pad = x.device.type == "cpu" and x.dtype != torch.float32
    start = 0
    for i, end in enumerate(offsets.tolist()):  # the one host sync
        if end > start:
            def mlp(h: torch.Tensor, i: int = i) -> torch.Tensor:
                return F.linear(silu_mul(F.linear(h, gate_up[i])), down[i])

            ys[start:end] = bucketed(mlp, xs[start:end]) if pad else mlp(xs[start:end])
        start = end
    return _unsort(ys, order)


def _cpu(x, top_k, order, offsets, gate_up, down, silu_mul) -> torch.Tensor:
    from tandem.engine.kernels import cpu_kernels

    xs = x[order // top_k]
    h = silu_mul(cpu_kernels.expert_gemm(xs, gate_up, offsets))
    ys = cpu_kernels.expert_gemm(h, down, offsets)
    held = torch.arange(len(order)) < offsets[-1]  # rows past it: other ranks' experts, unwritten
    return _unsort(torch.where(held[:, None], ys, 0), order)


def _triton(x, top_k, order, offsets, gate_up, down, silu_mul) -> torch.Tensor:
    from tandem.engine.models import moe_triton

    return moe_triton.expert_mlp(x, top_k, order, offsets, gate_up, down, silu_mul)


def _unsort(ys: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(ys)
    out[order] = ys
    return out


_IMPLS = {"grouped": _grouped, "per_expert": _per_expert, "cpu_kernel": _cpu, "triton": _triton}
IMPLEMENTATIONS = tuple(_IMPLS)
