"""Where one layer's K and V of a forward are written: the hand-off between the attention backend,
which owns the pool, and a layer op that writes them itself (RoPE fused with the store,
rope_kv_triton.py; attention/base.py `kv_slots`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSlots:
    """The pool's contiguous (slots, kv_heads, head_dim) K and V buffers of one layer, and each
    token's slot in them."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor  # (tokens,) int64
