"""FlashInfer attention on CUDA: paged prefill/decode wrappers over our pool.

The pool's per-layer K (and V) buffer, viewed as (num_pages, page_size,
kv_heads, head_dim), is FlashInfer's NHD paged layout, so no copy is needed.
The page table of request i is read off its req_to_token row:

    pages(i)        = req_to_token[row_i, 0 : seq_len_i : page_size] // page_size
    indptr[i+1]     = indptr[i] + ceil(seq_len_i / page_size)
    last_page_len_i = (seq_len_i - 1) % page_size + 1

FlashInfer aligns the causal mask bottom-right (query j of an extend of n
tokens over kv_len keys sits at kv_len - n + j), which is exactly our contract,
so MIXED batches run through the prefill wrapper with decode rows as 1-token
extends. Decode under CUDA graphs uses per-batch-size wrappers with static
buffers; see engine/cuda_graph_runner.py.
"""

from __future__ import annotations

import torch

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.runner.forward_batch import ForwardBatch, ForwardMode

_WORKSPACE_BYTES = 256 << 20


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, runner_ctx: object) -> None:
        super().__init__(runner_ctx)
        import flashinfer

        self._fi = flashinfer
        ctx = self.ctx
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Tensor-core decode kernels win once several query heads share a KV head.
        self._tensor_cores = ctx.num_heads // ctx.num_kv_heads >= 4
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._tensor_cores
        )
        self.active_decode_wrapper = self.decode_wrapper

    # ---- page tables -------------------------------------------------------------------
    def page_table(self, rows: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, ...]:
        """(indptr, indices, last_page_len) on the device; index math is done on the host
        from the CPU lengths so that building the table never syncs the stream."""
        P, dev = self.ctx.page_size, self.ctx.device
        n_pages = torch.tensor([-(-s // P) for s in seq_lens], dtype=torch.int64)
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = n_pages.cumsum(0)
        row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), n_pages)
        starts = torch.repeat_interleave(indptr[:-1].to(torch.int64), n_pages)
        col_of = (torch.arange(int(indptr[-1])) - starts) * P
        table = self.ctx.req_to_token_pool.req_to_token
        indices = table[row_of.to(dev, non_blocking=True), col_of.to(dev, non_blocking=True)] // P
        last = torch.tensor([(s - 1) % P + 1 for s in seq_lens], dtype=torch.int32)
        return indptr.to(dev, non_blocking=True), indices.to(torch.int32), last.to(dev, non_blocking=True)

    def plan_decode(self, wrapper: object, rows: list[int], seq_lens: list[int]) -> None:
        ctx = self.ctx
        indptr, indices, last = self.page_table(rows, seq_lens)
        wrapper.plan(  # type: ignore[attr-defined]
            indptr, indices, last, ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, ctx.page_size,
            pos_encoding_mode="NONE", q_data_type=ctx.dtype, kv_data_type=ctx.kv_pool.dtype,
            sm_scale=ctx.scaling,
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ctx = self.ctx
        if batch.mode == ForwardMode.DECODE:
            self.active_decode_wrapper = self.decode_wrapper
            self.plan_decode(self.decode_wrapper, batch.req_pool_indices_cpu, batch.seq_lens_cpu)
            return
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor(batch.extend_lens_cpu).cumsum(0)
        indptr, indices, last = self.page_table(batch.req_pool_indices_cpu, batch.seq_lens_cpu)
        self.prefill_wrapper.plan(
            qo_indptr.to(ctx.device, non_blocking=True), indptr, indices, last,
            ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, ctx.page_size,
            causal=True, sm_scale=ctx.scaling, q_data_type=ctx.dtype, kv_data_type=ctx.kv_pool.dtype,
        )

    # ---- forward -------------------------------------------------------------------------
    def _paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, P = self.ctx.kv_pool, self.ctx.page_size
        k = pool.k_buffer(layer)
        return k.view(-1, P, *k.shape[1:]), pool.v_buffer(layer).view(-1, P, *k.shape[1:])

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.ctx.kv_pool.set_kv(layer, batch.out_cache_loc, k, v)
        return self.prefill_wrapper.run(q.contiguous(), self._paged(layer)).flatten(1)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.ctx.kv_pool.set_kv(layer, batch.out_cache_loc, k, v)
        return self.active_decode_wrapper.run(q.contiguous(), self._paged(layer)).flatten(1)
