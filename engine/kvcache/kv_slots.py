"""Where one layer's K and V of a forward are written: the hand-off between the attention backend,
which owns the pool, and a layer op that writes them itself (RoPE fused with the store,
rope_kv_triton.py; attention/base.py `kv_slots`), or that also runs the decode attention over
them (a CPU decoder layer in one call; `paged_decode`)."""

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


@dataclass(frozen=True)
class PagedDecode:
    """A decode batch's paged attention, handed to a layer op that runs it itself together with
    the K/V store (models/fused_decode.py; attention/base.py `paged_decode`): the pool's K and V
    buffers of every layer, the request table, the batch's rows in it and their lengths (the new
    token counted), each token's slot, and the softmax scale."""

    k_buffers: tuple[torch.Tensor, ...]  # per layer, (slots, kv_heads, head_dim)
    v_buffers: tuple[torch.Tensor, ...]
    req_to_token: torch.Tensor  # (rows, max_ctx) int32
    rows: torch.Tensor  # (batch,) int64
    seq_lens: torch.Tensor  # (batch,) int32
    loc: torch.Tensor  # (tokens,) int64
    scale: float
