"""The attention-backend contract.

A backend computes causal attention for the new tokens of a ForwardBatch over
each request's whole sequence, reading the cached prefix from the paged KV pool.

Contract (tests/engine/test_attention_contract.py runs it against every backend):
- The caller has written `req_to_token[row, 0:seq_len]` for every request
  before `init_forward_metadata`; positions >= seq_len are never read.
- `init_forward_metadata(batch)` runs once per forward, before layer 0. It
  plans index tables and kernels; it reads but never writes the KV pool.
- `forward(q, k, v, layer, batch)` first stores this batch's `k`/`v` at
  `batch.out_cache_loc` in layer `layer` (its one side effect), then returns
  the attention output. Token t of request i attends to positions
  [0, prefix_lens[i] + t] of request i and nothing else.
- `kv_slots(layer, batch)` may instead offer the layer's pool slots to a layer op
  that fuses RoPE with the store (kvcache/rope_kv_triton.py); the model then passes
  `kv_stored=True`, and forward reads k/v (already in the pool) without storing
  them again. None (the default): forward stores them.
- `paged_decode(batch)` may instead hand a DECODE batch's whole paged attention (the K/V
  store included) to a layer op that runs it in the same kernels the backend would
  (models/fused_decode.py); the model then skips `forward` for that batch. None (the default):
  the model calls `forward` as usual.
- Shapes: q (num_tokens, num_heads, head_dim); k, v (num_tokens, num_kv_heads,
  head_dim); output (num_tokens, num_heads * head_dim) in q's dtype.
- EXTEND and MIXED batches go to `forward_extend`, DECODE to `forward_decode`.

A backend whose decode can be captured in a CUDA graph sets `supports_cuda_graph` and
implements the graph hooks (runner/cuda_graph_runner.py drives them): its captured
kernels may read only the static batch and buffers made by `graph_states`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kvcache.kv_slots import KVSlots, PagedDecode


class AttentionBackend(ABC):
    supports_cuda_graph = False

    def __init__(self, runner_ctx: object) -> None:
        # runner_ctx exposes: req_to_token_pool, kv_pool, device, num_heads,
        # num_kv_heads, head_dim, scaling, dtype, page_size, config (its RunnerConfig).
        self.ctx = runner_ctx

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def kv_slots(self, layer: int, batch: ForwardBatch) -> KVSlots | None:
        """Where a fused RoPE + store may write this layer's k and v, or None: forward stores them."""
        return None

    def paged_decode(self, batch: ForwardBatch) -> PagedDecode | None:
        """A decode batch's paged attention for a layer op that runs it itself, or None."""
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """`kv_stored`: the caller wrote k and v to the slots `kv_slots` gave it."""
        if not kv_stored:
            self.ctx.kv_pool.set_kv(layer, batch.out_cache_loc, k, v)  # type: ignore[attr-defined]
        if batch.mode == ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    # ---- CUDA-graph hooks (only where supports_cuda_graph) ----------------------------------
    def graph_states(self, buckets: list[int], max_pages: int) -> dict[int, object]:
        """Per bucket batch size, the fixed index buffers its captured decode reads."""
        raise NotImplementedError

    def plan_graph_decode(self, state: object, batch: ForwardBatch) -> None:
        """Plan `state` for `batch` (a static, padded decode batch, its host lists current); runs
        outside the graph, before every replay."""
        raise NotImplementedError

    def graph_decode_metadata(self, state: object, batch: ForwardBatch) -> None:
        """Captured inside the graph before layer 0: whatever `state` needs computed on the device
        from the static batch's device tensors (the default: nothing)."""
        return None

    def use_graph_state(self, state: object | None) -> None:
        """Decode forwards read `state` (None: back to the eager metadata)."""
        raise NotImplementedError
