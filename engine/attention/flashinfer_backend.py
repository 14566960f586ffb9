"""FlashInfer attention on CUDA: paged prefill/decode wrappers over our pool.

The pool's per-layer K (and V) buffer, viewed as (num_pages, page_size,
kv_heads, head_dim), is FlashInfer's NHD paged layout, so no copy is needed.
The page table of request i is read off its req_to_token row:

    pages(i)        = req_to_token[row_i, 0 : seq_len_i : page_size] // page_size
    indptr[i+1]     = indptr[i] + ceil(seq_len_i / page_size)
    last_page_len_i = (seq_len_i - 1) % page_size + 1

indptr and last_page_len are made on the host from the batch's CPU lengths and
handed to `plan` there: plan schedules its kernels from host copies of both, so
device ones would cost a device-to-host sync every step. The page indices are
gathered on the device from the batch's own device tensors (`page_indices`), so
no per-step host array of page numbers crosses the bus either.

FlashInfer aligns the causal mask bottom-right (query j of an extend of n
tokens over kv_len keys sits at kv_len - n + j), which is exactly our contract,
so MIXED batches run through the prefill wrapper with decode rows as 1-token
extends. An extend batch in which no request has a cached prefix (a fresh
prompt, or the first chunk of one) runs the ragged prefill kernel over the
forward's own k/v instead: the same causal attention with no page table.
Decode under CUDA graphs uses one wrapper per bucket, all over shared fixed
buffers (runner/cuda_graph_runner.py).
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from tandem.engine.attention import page_gather, split_kv
from tandem.engine.attention.base import AttentionBackend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kvcache import rope_kv_triton
from tandem.engine.kvcache.kv_slots import KVSlots

_WORKSPACE_BYTES = 256 << 20


def page_indices(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, total: int,
                 page_size: int) -> torch.Tensor:
    """Every request's page numbers, concatenated: (total,) int32 on the table's device.

    Flat entry t belongs to request i = the one whose pages span t; it is page
    (t - first_i) of that request, read at column (t - first_i) * page_size of its row.
    `total` (the pages of all requests, known on the host) sizes every intermediate,
    so nothing here waits for the device."""
    n = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    first = torch.cumsum(n, 0) - n
    row_of = torch.repeat_interleave(rows, n, output_size=total)
    col_of = torch.arange(total, device=table.device) - torch.repeat_interleave(first, n, output_size=total)
    return (table[row_of, col_of * page_size] // page_size).to(torch.int32)


def host_page_counts(seq_lens_cpu: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr, last_page_len) as int32 CPU tensors, made by numpy (this runs every step: no torch op)."""
    seq = np.asarray(seq_lens_cpu, dtype=np.int32)
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum((seq + page_size - 1) // page_size, out=indptr[1:])
    return torch.from_numpy(indptr), torch.from_numpy((seq - 1) % page_size + 1)


@dataclass(eq=False)
class GraphDecodeState:
    """One bucket's decode wrapper and the fixed buffers it reads (shared with every bucket): the
    graph fills them (`graph_decode_metadata`), the host only plans."""

    wrapper: object
    indptr: torch.Tensor  # (bs + 1,) int32
    indices: torch.Tensor  # (max_bs * max_pages,) int32
    last: torch.Tensor  # (bs,) int32
    planned: bool = False


def fast_decode_plan(flashinfer: object) -> object | None:
    """FlashInfer's own re-plan for CUDA-graph decode wrappers (flashinfer.decode.fast_decode_plan,
    what SGLang serves with): the schedule from host indptr / last_page_len, without copying the
    index tables into the fixed buffers (the graph fills those itself) and without the checks
    of a first plan. None where FlashInfer has none: every plan is then a full one."""
    try:
        return getattr(importlib.import_module(f"{flashinfer.__name__}.decode"), "fast_decode_plan", None)
    except ImportError:
        return None


def graph_index_buffers(max_bs: int, max_pages: int, device: torch.device | str) -> list[torch.Tensor]:
    """The fixed (indptr, page indices, last_page_len) every captured decode reads, sized for
    the largest bucket; runner/graph_memory.py counts them on the meta device."""
    return [torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            torch.zeros(max_bs * max_pages, dtype=torch.int32, device=device),
            torch.zeros(max_bs, dtype=torch.int32, device=device)]


def decode_tensor_cores(ctx: object) -> bool:
    """Whether decode runs FlashInfer's tensor-core kernel (its prefill kernel, one query row
    per request) or the CUDA-core decode kernel. The tensor-core one wins once several query
    heads share a KV head (SGLang's rule: 4 or more); `decode_tensor_cores` in the runner's
    config overrides it, to measure both (bench/gpu_decode.py --engine-arg)."""
    forced = ctx.config.decode_tensor_cores  # type: ignore[attr-defined]
    return forced if forced is not None else ctx.num_heads // ctx.num_kv_heads >= 4  # type: ignore[attr-defined]


def fused_rope_kv(ctx: object) -> bool:
    """Whether the backend offers its pool slots to a layer op that fuses RoPE with the K/V store
    (`fused_rope_kv` in the runner's config; None: where the Triton kernel runs, CUDA). Only
    layer ops that can fuse take them (FlashInfer's); the others keep the backend's store."""
    setting = ctx.config.fused_rope_kv  # type: ignore[attr-defined]
    # Checked in this order, each only where the last holds. The kernel stores what it computes:
    # a pool of another dtype than the activations needs the converting store (memory_pool.set_kv).
    runs = (rope_kv_triton.available(torch.device(ctx.device))  # type: ignore[attr-defined]
            and rope_kv_triton.supports(ctx.head_dim)  # type: ignore[attr-defined]
            and ctx.kv_pool.dtype == ctx.dtype)  # type: ignore[attr-defined]
    if setting and not runs:
        raise ValueError("fused_rope_kv=true needs Triton on a CUDA device, head_dim 64, 128 or 256 and a KV pool "
                         "of the activation dtype")
    return runs if setting is None else setting


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, runner_ctx: object) -> None:
        super().__init__(runner_ctx)
        import flashinfer

        self._fi = flashinfer
        ctx = self.ctx
        # Zeroed, as FlashInfer's docstrings ask: some of its kernels keep counters in the
        # workspace that must start at zero, and a reused allocator block holds stale bytes.
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Extends with no cached prefix attend over their own new K/V only: the ragged kernel
        # reads those straight from the forward's k/v, with no page table (SGLang does the same).
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self._ragged = False
        self._tensor_cores = decode_tensor_cores(ctx)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._tensor_cores
        )
        self.active_decode_wrapper = self.decode_wrapper
        # The device's own event: torch.cpu.Event is a no-op, except under the CPU tests' stand-in,
        # where it is the fence of the stand-in's asynchronous plan copies.
        self._events = torch.get_device_module(torch.device(ctx.device))
        self._planned: dict[int, torch.cuda.Event | torch.cpu.Event] = {}
        self._one_launch = page_gather.available(torch.device(ctx.device))  # the page table in one kernel
        self._fast_plan = fast_decode_plan(flashinfer)
        self._sms = split_kv.sm_count(torch.device(ctx.device))
        self._fused_rope_kv = fused_rope_kv(ctx)

    def _split_kv_off(self, batch_size: int) -> bool:
        """disable_split_kv for a decode plan (split_kv.py): a function of the batch size alone, so
        each graph bucket's wrapper is planned alike at capture and at every replay."""
        return split_kv.split_kv_off(batch_size, self.ctx.num_kv_heads, self._sms, self.ctx.config.decode_split_kv)

    # ---- plans -------------------------------------------------------------------------------
    def _table(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        P = self.ctx.page_size
        indptr, last = host_page_counts(batch.seq_lens_cpu, P)
        table = self.ctx.req_to_token_pool.req_to_token
        total = int(indptr[-1])
        if self._one_launch:
            return indptr, page_gather.gather_page_indices(table, batch.req_pool_indices, indptr, total, P), last
        return indptr, page_indices(table, batch.req_pool_indices, batch.seq_lens, total, P), last

    def _fenced_plan(self, wrapper: object, *args: object, plan: object = None, **kw: object) -> None:
        """plan() fills a pinned host buffer and queues its copy to the device without waiting.
        Planning the same wrapper again before that copy ran would overwrite the buffer under it,
        so wait for the previous plan's copy first: the host stays at most one step ahead of
        the device, which is the overlap we want (plan N+1 while step N runs)."""
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        (plan or wrapper.plan)(*args, **kw)  # type: ignore[attr-defined, operator]
        done = self._events.Event()
        done.record()
        self._planned[id(wrapper)] = done

    def _plan_decode(self, wrapper: object, batch: ForwardBatch, tables: tuple | None = None,
                     plan: object = None) -> None:
        ctx = self.ctx
        indptr, indices, last = tables or self._table(batch)
        self._fenced_plan(
            wrapper, indptr, indices, last, ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, ctx.page_size,
            plan=plan, pos_encoding_mode="NONE", q_data_type=ctx.dtype, kv_data_type=ctx.kv_pool.dtype,
            sm_scale=ctx.scaling, disable_split_kv=self._split_kv_off(batch.batch_size),
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ctx = self.ctx
        if batch.mode == ForwardMode.DECODE:
            self.active_decode_wrapper = self.decode_wrapper
            self._plan_decode(self.decode_wrapper, batch)
            return
        qo_indptr = torch.tensor([0, *itertools.accumulate(batch.extend_lens_cpu)], dtype=torch.int32)
        self._ragged = batch.seq_lens_cpu == batch.extend_lens_cpu  # no request has a cached prefix
        if self._ragged:
            self._fenced_plan(
                self.ragged_wrapper, qo_indptr, qo_indptr, ctx.num_heads, ctx.num_kv_heads, ctx.head_dim,
                causal=True, sm_scale=ctx.scaling, q_data_type=ctx.dtype, kv_data_type=ctx.kv_pool.dtype,
            )
            return
        indptr, indices, last = self._table(batch)
        self._fenced_plan(
            self.prefill_wrapper, qo_indptr, indptr, indices, last,
            ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, ctx.page_size,
            causal=True, sm_scale=ctx.scaling, q_data_type=ctx.dtype, kv_data_type=ctx.kv_pool.dtype,
        )

    # ---- CUDA graphs -------------------------------------------------------------------------
    def graph_states(self, buckets: list[int], max_pages: int) -> dict[int, object]:
        """One wrapper per bucket, all over one set of buffers sized for the largest: one graph
        runs at a time and plans are stream-ordered, so sharing is safe and the page-index
        buffer (max_bs * max_pages entries) exists once, not once per bucket."""
        indptr, indices, last = graph_index_buffers(max(buckets), max_pages, self.ctx.device)
        return {bs: GraphDecodeState(self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
            paged_kv_indptr_buffer=indptr[: bs + 1], paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last[:bs],
        ), indptr[: bs + 1], indices, last[:bs]) for bs in buckets}

    def plan_graph_decode(self, state: object, batch: ForwardBatch) -> None:
        """Outside the graph, every replay: the kernels' schedule from the host's lengths. The first
        plan of a bucket (at capture) is FlashInfer's full one; later ones its fast re-plan, which
        leaves the index tables to the graph (`graph_decode_metadata`)."""
        st: GraphDecodeState = state  # type: ignore[assignment]
        if not st.planned or self._fast_plan is None:
            self._plan_decode(st.wrapper, batch)
            st.planned = True
            return
        indptr, last = host_page_counts(batch.seq_lens_cpu, self.ctx.page_size)
        self._plan_decode(st.wrapper, batch, (indptr, st.indices, last), plan=partial(self._fast_plan, st.wrapper))

    def graph_decode_metadata(self, state: object, batch: ForwardBatch) -> None:
        """Inside the graph, before layer 0: the bucket's indptr, last-page lengths and page indices
        from the static batch's device lengths and rows, into the fixed buffers its kernels read.
        The same values as the host's plan, derived from the same lengths (graph_inputs.py)."""
        st: GraphDecodeState = state  # type: ignore[assignment]
        P, bs = self.ctx.page_size, batch.batch_size
        seq = batch.seq_lens
        st.indptr[:1].zero_()
        torch.cumsum((seq + P - 1) // P, 0, dtype=torch.int32, out=st.indptr[1:])
        st.last.copy_((seq - 1) % P + 1)
        table = self.ctx.req_to_token_pool.req_to_token
        if self._one_launch:
            page_gather.gather_into(table, batch.req_pool_indices, st.indptr, st.indices, P, bs)
        else:  # the CPU tests' path: a total known only from the device (no graph to break here)
            total = int(st.indptr[-1])
            st.indices[:total].copy_(page_indices(table, batch.req_pool_indices, seq, total, P))

    def use_graph_state(self, state: object | None) -> None:
        self.active_decode_wrapper = state.wrapper if state is not None else self.decode_wrapper  # type: ignore[attr-defined]

    # ---- forward -----------------------------------------------------------------------------
    def kv_slots(self, layer: int, batch: ForwardBatch) -> KVSlots | None:
        if not self._fused_rope_kv:
            return None
        pool = self.ctx.kv_pool
        return KVSlots(pool.k_buffer(layer), pool.v_buffer(layer), batch.out_cache_loc)

    def _paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, P = self.ctx.kv_pool, self.ctx.page_size
        k = pool.k_buffer(layer)
        return k.view(-1, P, *k.shape[1:]), pool.v_buffer(layer).view(-1, P, *k.shape[1:])

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        # k/v are in the pool (forward stored them, or the fused RoPE did). q goes as the strided
        # view of the qkv rows it is: both prefill kernels read it through its row and head strides
        # (FA2: csrc/batch_prefill.cu and batch_prefill_paged.cuh; FA3, which Hopper runs: its TMA
        # descriptor is built from the same strides, csrc/batch_prefill_sm90.cu, which need only
        # be 16-byte multiples, as a qkv row's are). Only FlashInfer's trtllm-gen and fmha_v2
        # paths copy q, and neither serves these wrappers on Hopper.
        if self._ragged:
            return self.ragged_wrapper.run(q, k, v).flatten(1)
        return self.prefill_wrapper.run(q, self._paged(layer)).flatten(1)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        # q as the model hands it over, a strided view of the qkv rows: both decode kernels read
        # q through its row and head strides (csrc/batch_decode.cu, batch_prefill.cu), so a copy
        # would cost a launch per layer for nothing. (FlashInfer copies q itself only for its
        # trtllm-gen backend, which this wrapper does not use.)
        return self.active_decode_wrapper.run(q, self._paged(layer)).flatten(1)
