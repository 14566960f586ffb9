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
measured. The LM head runs on one row per request, so its tile is a decode-sized one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.layers import PackedLinear

# Rows per matmul call. Measured on SmolLM2-135M's shapes (bench/deterministic_cost.py):
# 16 rows cost ~1.1-1.3x at decode and ~1.5x at a 2048-token prefill against the free shapes.
LAYER_ROWS = 16
HEAD_ROWS = 8

Matmul = Callable[[torch.Tensor], torch.Tensor]


def tiled(fn: Matmul, x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn over `x` in tiles of exactly `rows` rows; returns x's rows of the result."""
    n = x.shape[0]
    m = max(-(-n // rows), 1) * rows  # no rows: one tile of padding, sliced away
    if m != n or not x.is_contiguous():
        x = F.pad(x, (0, 0, 0, m - n)).contiguous()  # a fresh tensor: every tile at a fixed alignment
    if m == rows:
        return fn(x)[:n]
    return torch.cat([fn(x[i : i + rows]) for i in range(0, m, rows)])[:n]


class InvariantLinear(nn.Module):
    """A linear layer (nn.Linear or the CPU's PackedLinear) run in fixed-shape tiles."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows
        if isinstance(inner, PackedLinear):
            self._fn: Matmul = inner._mm  # the unbucketed call: tiles replace the row buckets
        elif isinstance(inner, nn.Linear):
            self._fn = lambda x: F.linear(x, inner.weight, inner.bias)
        else:  # a tied head: the embedding's weight
            self._fn = lambda x: F.linear(x, inner.weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(self._fn, x, self.rows)


def make_batch_invariant(model: nn.Module, layer_rows: int = LAYER_ROWS, head_rows: int = HEAD_ROWS) -> int:
    """Wrap every linear of `model` (and its LM head) in InvariantLinear; returns how many.

    Call after packing (layers.pack_linears): the wrapper calls the packed kernel directly."""
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, (nn.Linear, PackedLinear)) and not n.endswith("lm_head") and n != "packed_head"]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, InvariantLinear(mod, layer_rows))
    head = getattr(model, "packed_head", None) or getattr(model, "lm_head", None)
    if head is None:
        return len(targets)
    model.packed_head = InvariantLinear(head, head_rows)  # the model computes its logits through this
    return len(targets) + 1
