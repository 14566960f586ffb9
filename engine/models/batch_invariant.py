"""Batch-invariant matmuls: a row's product depends on that row alone, never on its batch.

A BLAS or oneDNN matmul picks its kernel by shape. A decode step of 3 rows, a prefill of 700
and a cache hit's extend of 2 may each run another kernel (MKL's gemv below 4 rows, oneDNN's
AMX tiles above a threshold, another K blocking), and each kernel sums the K products in its
own order. In bf16 the orders differ in the last bits, and greedy decoding amplifies one bit
into another answer (issue 43: the README's question answered two ways after a cache hit).

The fix here does not reorder anyone's kernel. Every call a deterministic model makes has one
shape: `rows` rows. Inputs are cut into tiles of exactly that many rows (the last one padded
with zeros), and each tile goes through the same library call, so every row of every batch is
computed by the same kernel in the same order. No GEMM mixes rows, so a row's result cannot
depend on what shares its tile. A library call is deterministic for a fixed shape, thread
count and alignment; tiles start at multiples of `rows * in_features` elements of one fresh
tensor, so their alignment is fixed too.

What it costs (docs/benchmarks.md, "Deterministic mode"): small tiles keep decode at its
speed and make large prefills pay for many calls; LAYER_ROWS balances the two on the shapes
measured. The LM head also runs in blocks of its vocabulary rows (HEAD_COLS).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.layers import PackedLinear

# Rows per matmul call. Measured on SmolLM2-135M's shapes (bench/deterministic_cost.py): 8 rows
# keep decode at its speed but halve a prefill's, 32 the reverse; 16 is between.
LAYER_ROWS = 16
HEAD_ROWS = 16
# Vocabulary rows of the LM head per call: a block of the head's weight (4.5 MiB in bf16 at
# hidden 576) stays in cache while every row tile of the batch passes it, where the whole head
# (56 MiB) would be read from memory once per tile.
HEAD_COLS = 4096

Matmul = Callable[[torch.Tensor], torch.Tensor]


def tiled(blocks: list[Matmul], x: torch.Tensor, rows: int) -> torch.Tensor:
    """The column blocks' results side by side, each computed over `x` in tiles of exactly `rows`
    rows; x's rows of the result."""
    n = x.shape[0]
    m = max(-(-n // rows), 1) * rows  # no rows: one tile of padding, sliced away
    if m != n or not x.is_contiguous():
        x = F.pad(x, (0, 0, 0, m - n)).contiguous()  # a fresh tensor: every tile at a fixed alignment
    if m == rows and len(blocks) == 1:
        return blocks[0](x)[:n]
    # block-major: one block's weight stays in cache while every tile passes it
    parts = [torch.cat([fn(x[i : i + rows]) for i in range(0, m, rows)]) for fn in blocks]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))[:n]


class InvariantLinear(nn.Module):
    """y = x W^T (+ b) in fixed-shape calls: tiles of `rows` rows, and blocks of `cols` outputs
    (one block when None), each block's weight packed for oneDNN when `pack`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, cols: int | None = None,
                 pack: bool = False) -> None:
        super().__init__()
        self.rows = rows
        self.out_features, self.in_features = weight.shape
        step = cols or self.out_features
        spans = [(lo, min(lo + step, self.out_features)) for lo in range(0, self.out_features, step)]
        weights = [weight[lo:hi].detach() for lo, hi in spans]
        biases = [None if bias is None else bias[lo:hi].detach() for lo, hi in spans]
        if pack:
            self.blocks = nn.ModuleList(PackedLinear(w, b) for w, b in zip(weights, biases))
            self._fns: list[Matmul] = [blk._mm for blk in self.blocks]  # unbucketed: tiles replace the buckets
        else:
            # views of the model's own weights, kept out of buffers so that nothing counts them twice
            self._fns = [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in zip(weights, biases)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(self._fns, x, self.rows)


def make_batch_invariant(model: nn.Module, pack: bool, layer_rows: int = LAYER_ROWS,
                         head_rows: int = HEAD_ROWS) -> int:
    """Every nn.Linear of `model` as an InvariantLinear, and its LM head in column blocks through
    `packed_head` (which the model's forward prefers); returns how many. Use instead of
    layers.pack_linears: `pack` packs the blocks themselves."""
    targets = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and not n.endswith("lm_head")]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                InvariantLinear(mod.weight, mod.bias, layer_rows, pack=pack))
    head = getattr(model, "lm_head", None)
    if head is None:
        return len(targets)
    model.packed_head = InvariantLinear(head.weight, None, head_rows, HEAD_COLS, pack=pack)
    if head is not getattr(model, "embed_tokens", None):
        model.lm_head = model.packed_head  # untied: the blocks replace it (tied: the embedding stays)
    return len(targets) + 1
