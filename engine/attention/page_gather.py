"""A batch's page table for FlashInfer in one kernel launch (Triton), on CUDA.

The same result as flashinfer_backend.page_indices, which builds it from about a dozen small
torch ops (cumsum, two repeat_interleaves, a gather, ...). On a GPU each op costs a launch on
the forward thread, ~30 us apiece on the H200 host measured (docs/gpu.md), so the table cost
0.4-0.5 ms a decode step there. Here program i copies request i's pages:

    out[indptr[i] + j] = table[rows[i], j * page_size] // page_size     for j < indptr[i+1] - indptr[i]

`indptr` is the plan's host indptr, copied to the device (small, non-blocking).
Tested against page_indices on CPU through Triton's interpreter and on the GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: page_indices serves
    triton = None

BLOCK = 256

if triton is not None:

    @triton.jit
    def _gather(table, stride, rows, indptr, out, page_size, BLOCK: tl.constexpr):  # noqa: N803
        i = tl.program_id(0)
        row = tl.load(rows + i).to(tl.int64)
        start = tl.load(indptr + i)
        n = tl.load(indptr + i + 1) - start
        for off in range(0, n, BLOCK):
            j = off + tl.arange(0, BLOCK)
            keep = j < n
            slot = tl.load(table + row * stride + j.to(tl.int64) * page_size, mask=keep)
            tl.store(out + start + j, (slot // page_size).to(tl.int32), mask=keep)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def gather_page_indices(table: torch.Tensor, rows: torch.Tensor, indptr: torch.Tensor, total: int,
                        page_size: int) -> torch.Tensor:
    """(total,) int32 page numbers of every request, on the table's device. `indptr` is the
    host indptr (int32, batch + 1); `rows` the requests' rows of `table` on its device."""
    out = torch.empty(total, dtype=torch.int32, device=table.device)
    batch = len(indptr) - 1
    if batch == 0 or total == 0:
        return out
    gather_into(table, rows, indptr.to(table.device, non_blocking=True), out, page_size, batch)
    return out


def gather_into(table: torch.Tensor, rows: torch.Tensor, dev_indptr: torch.Tensor, out: torch.Tensor,
                page_size: int, batch: int) -> None:
    """The kernel alone, over device tensors only: `out[indptr[i]:indptr[i+1]]` for i < batch. It needs
    no host value but the batch size, so a CUDA graph captures it (flashinfer_backend's in-graph
    decode metadata)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    _gather[(batch,)](table, table.stride(0), rows, dev_indptr, out, page_size, BLOCK=BLOCK)
