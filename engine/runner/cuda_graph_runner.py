"""CUDA graphs for decode batches (FlashInfer backend only).

Decode forwards are captured once per batch-size bucket over static input
buffers. At replay a batch of size b runs in the smallest bucket B >= b; rows
b..B-1 are padding:

    padding row: req_pool_index = 0, seq_len = 1, out_cache_loc = 0 (page 0)

Page 0 is reserved in the KV pool, so padded writes land nowhere live and the
padded reads are of finite data. The FlashInfer decode wrapper of each bucket
owns fixed index buffers, and `plan` (outside the graph) refills them.
"""

from __future__ import annotations

import bisect

import torch

from tandem.engine.runner.forward_batch import ForwardBatch, ForwardMode


def _buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, runner: object, max_bs: int) -> None:
        import flashinfer

        self.runner = runner
        backend = runner.attn_backend  # type: ignore[attr-defined]
        self.backend = backend
        self.buckets = _buckets(max_bs)
        self.max_bs = self.buckets[-1]
        dev = runner.device  # type: ignore[attr-defined]
        P = runner.page_size  # type: ignore[attr-defined]
        max_pages = -(-runner.max_context_len // P)  # type: ignore[attr-defined]
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.wrappers: dict[int, object] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first so smaller graphs reuse its memory
            self.wrappers[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=backend._tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(bs * max_pages, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=dev),
            )
            self._capture(bs)

    def _static_batch(self, bs: int, seq_lens_cpu: list[int], rows: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            req_pool_indices_cpu=rows, seq_lens=self.seq_lens[:bs], seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=[s - 1 for s in seq_lens_cpu], extend_lens_cpu=[1] * bs,
            num_extend_reqs=0, logits_indices=torch.arange(bs, device=self.input_ids.device),
        )

    def _capture(self, bs: int) -> None:
        batch = self._static_batch(bs, [1] * bs, [0] * bs)
        self.backend.plan_decode(self.wrappers[bs], [0] * bs, [1] * bs)
        self.backend.active_decode_wrapper = self.wrappers[bs]
        model = self.runner.model  # type: ignore[attr-defined]
        with torch.inference_mode():
            for _ in range(2):  # warm up kernels and allocator outside the graph
                model(batch, self.backend)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = model(batch, self.backend)
        self.graphs[bs] = graph
        self.backend.active_decode_wrapper = self.backend.decode_wrapper

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        b = batch.batch_size
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        pad = bs - b
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.out_cache_loc[:b].copy_(batch.out_cache_loc)
        self.req_pool_indices[:b].copy_(batch.req_pool_indices)
        self.seq_lens[:b].copy_(batch.seq_lens)
        if pad:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
            self.req_pool_indices[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
        rows = batch.req_pool_indices_cpu + [0] * pad
        self.backend.plan_decode(self.wrappers[bs], rows, batch.seq_lens_cpu + [1] * pad)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
