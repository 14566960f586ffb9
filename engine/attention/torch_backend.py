"""Attention on CPU (or any device): fused paged kernels on CPU, torch SDPA elsewhere.

Extend, on CPU with the fused kernel (cpu_kernels.enabled("extend_attention")): one call per layer
for every extend request, reading the cached prefix and the just-stored new K/V
straight from the pool through req_to_token.

Extend otherwise: one SDPA call per extend request. A request with no cached prefix
attends over its own fresh k/v (no gather, plain causal mask). With a prefix,
its K/V are gathered from the pool by `req_to_token` and the causal mask is
aligned to the bottom-right:

    q token j (position prefix+j) sees kv positions 0 .. prefix+j

Decode, on CPU with the fused kernel (cpu_kernels.enabled("decode_attention")): one call per
layer reads K/V straight from the pool through req_to_token; the metadata is
just the decode requests' rows and seq_lens (views into the batch, no copy).

Decode otherwise: all decode requests in ONE batched SDPA call. Their KV slots
are gathered into a padded (batch, max_len) table once per forward (shared by
all layers); padding points at the reserved page 0 and is masked out.

Deterministic mode (RunnerConfig.deterministic): every token of every batch, decode rows
included, goes through the extend kernel's fp32-lane form. That kernel reduces one query row
at a time over kv blocks at absolute positions (0, 32, 64, ...), so a token's attention is the
same bits whether it was decoded, prefilled cold, prefilled after a cache hit or in another
chunk: the decode kernel's thread-count splits, the AMX tiles' unspecified sum order and
SDPA's shape-chosen kernels are all left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kernels import cpu_kernels
from tandem.engine.kvcache.kv_slots import PagedDecode


@dataclass
class _ExtendItem:
    start: int  # first token of the request in the flattened batch
    end: int
    kv_index: torch.Tensor | None  # (seq_len,) slots, None when there is no prefix
    mask: torch.Tensor | None  # (extend_len, seq_len) bool, None when plain causal


@dataclass
class _Metadata:
    extends: list[_ExtendItem]
    decode_start: int  # first decode token in the flattened batch
    num_decode: int
    # fused kernel path: rows in req_to_token and sequence lengths of the decode requests
    decode_rows: torch.Tensor | None = None  # (num_decode,) int64
    decode_seq_lens: torch.Tensor | None = None  # (num_decode,) int32
    # gather path
    decode_index: torch.Tensor | None = None  # (num_decode, max_len) int64 slots
    decode_mask: torch.Tensor | None = None  # (num_decode, 1, 1, max_len) bool
    # fused extend kernel: per extend request, its row, prefix, new tokens and first q row
    extend_kernel_args: tuple[torch.Tensor, ...] | None = None


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, runner_ctx: object) -> None:
        super().__init__(runner_ctx)
        ctx = self.ctx
        # Decided once: the first call may compile the kernel (seconds, then cached on disk),
        # and the CPU plan may keep either phase on torch where its kernel form is slower.
        shape_ok = torch.device(ctx.device).type == "cpu" and cpu_kernels.supports(
            ctx.head_dim, ctx.num_heads, ctx.num_kv_heads, ctx.kv_pool.dtype
        )
        self.use_extend_kernel = shape_ok and cpu_kernels.enabled("extend_attention")
        self.use_decode_kernel = shape_ok and cpu_kernels.enabled("decode_attention")
        self.use_amx = True  # bf16 extend products on AMX tiles where the build has them
        # The runner refused the mode where the extend kernel cannot run (ModelRunner._check_deterministic).
        self.deterministic = bool(getattr(ctx.config, "deterministic", False))
        if self.deterministic:
            self.use_extend_kernel, self.use_decode_kernel, self.use_amx = True, False, False
        # The decode kernel's per-layer K/V views, for a decoder layer that runs it itself (paged_decode):
        # views of the pool's one buffer, fixed for its life.
        layers = range(ctx.kv_pool.num_layers) if self.use_decode_kernel else range(0)
        self._k_layers = tuple(ctx.kv_pool.k_buffer(i) for i in layers)
        self._v_layers = tuple(ctx.kv_pool.v_buffer(i) for i in layers)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.ctx.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices
        # Deterministic mode: a decode is an extend of one token on its prefix, for the extend kernel.
        n_ext = batch.batch_size if self.deterministic else batch.num_extend_reqs
        extends: list[_ExtendItem] = []
        start = 0
        for i in range(n_ext):
            prefix, seq = batch.prefix_lens_cpu[i], batch.seq_lens_cpu[i]
            n = seq - prefix
            item = _ExtendItem(start, start + n, None, None)
            if prefix > 0 and not self.use_extend_kernel:
                item.kv_index = table[rows[i], :seq].to(torch.int64)
                q_pos = torch.arange(prefix, seq, device=table.device)
                item.mask = torch.arange(seq, device=table.device)[None, :] <= q_pos[:, None]
            extends.append(item)
            start += n
        n_dec = batch.batch_size - n_ext
        meta = _Metadata(extends, start, n_dec)
        if extends and self.use_extend_kernel:
            i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
            meta.extend_kernel_args = (
                rows[:n_ext].to(torch.int64).contiguous(),
                i32(batch.prefix_lens_cpu[:n_ext]),
                i32(batch.extend_lens_cpu[:n_ext]),
                i32([it.start for it in extends]),
            )
        if n_dec and self.use_decode_kernel:
            # views (no copy) when ForwardBatch.build made them: int64 rows, int32 lengths
            meta.decode_rows = rows[n_ext:].to(torch.int64).contiguous()
            meta.decode_seq_lens = batch.seq_lens[n_ext:].to(torch.int32).contiguous()
        elif n_dec:
            dec_lens = batch.seq_lens[n_ext:]
            max_len = max(batch.seq_lens_cpu[n_ext:])
            cols = torch.arange(max_len, device=table.device)
            valid = cols[None, :] < dec_lens[:, None]
            index = table[rows[n_ext:], :max_len].to(torch.int64)
            meta.decode_index = torch.where(valid, index, 0)  # pad -> reserved page 0
            meta.decode_mask = valid[:, None, None, :]
        batch.attn_metadata = meta

    def paged_decode(self, batch: ForwardBatch) -> PagedDecode | None:
        """The decode kernel's arguments, for a decoder layer run in one call (models/fused_decode.py),
        when this batch would run that kernel: a decode batch, not deterministic, over an fp32 or bf16
        pool (an fp8 one, with its scales, never takes the kernel: `supports`)."""
        meta: _Metadata | None = batch.attn_metadata
        if batch.mode != ForwardMode.DECODE or meta is None or meta.decode_rows is None:
            return None
        return PagedDecode(self._k_layers, self._v_layers, self.ctx.req_to_token_pool.req_to_token,
                           meta.decode_rows, meta.decode_seq_lens, batch.out_cache_loc, self.ctx.scaling)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: _Metadata = batch.attn_metadata  # k/v are in the pool: forward stored them
        kbuf, vbuf = self.ctx.kv_pool.k_buffer(layer), self.ctx.kv_pool.v_buffer(layer)
        if meta.extend_kernel_args is not None:
            out = cpu_kernels.paged_extend_attention(
                q.to(kbuf.dtype), kbuf, vbuf, self.ctx.req_to_token_pool.req_to_token,
                *meta.extend_kernel_args, self.ctx.scaling, self.use_amx,
            ).to(q.dtype)
        else:
            out = self._extend_sdpa(q, k, v, kbuf, vbuf, meta, layer)
        if meta.num_decode:
            s = meta.decode_start
            out[s:] = self._decode(q[s:], layer, meta)
        return out.flatten(1)

    def _extend_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kbuf: torch.Tensor,
                     vbuf: torch.Tensor, meta: _Metadata, layer: int) -> torch.Tensor:
        out = torch.empty_like(q)
        ks, vs = self._scales(layer)
        for it in meta.extends:
            # 4-D inputs: with a leading batch dim torch takes its flash CPU kernel,
            # with 3-D it falls back to the math path (measured ~7x slower in bf16).
            qi = q[it.start : it.end].transpose(0, 1)[None]  # (1, heads, n, dim)
            pooled = it.kv_index is not None  # else this step's own k/v, never quantized
            if pooled:
                ki, vi = kbuf[it.kv_index], vbuf[it.kv_index]  # (seq, kv_heads, dim)
            else:
                ki, vi = k[it.start : it.end], v[it.start : it.end]
            o = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1)[None].to(q.dtype), vi.transpose(0, 1)[None].to(q.dtype),
                attn_mask=it.mask, is_causal=it.mask is None,
                scale=self.ctx.scaling * (ks if pooled else 1.0), enable_gqa=True,
            )
            o = o[0].transpose(0, 1)
            out[it.start : it.end] = o * vs if pooled and vs != 1.0 else o
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        if self.deterministic:
            return self.forward_extend(q, k, v, layer, batch)
        return self._decode(q, layer, batch.attn_metadata).flatten(1)

    def _decode(self, q: torch.Tensor, layer: int, meta: _Metadata) -> torch.Tensor:
        if meta.decode_rows is not None:
            return self._decode_kernel(q, layer, meta)
        b, n = meta.decode_index.shape
        hkv, d = self.ctx.num_kv_heads, self.ctx.head_dim
        flat = meta.decode_index.view(-1)
        # index_select on (slots, kv_heads*dim) rows is a plain row memcpy, ~2.5x
        # faster than advanced indexing over the 3-D buffer.
        ki = self.ctx.kv_pool.k_buffer(layer).view(-1, hkv * d).index_select(0, flat)
        vi = self.ctx.kv_pool.v_buffer(layer).view(-1, hkv * d).index_select(0, flat)
        ki = ki.view(b, n, hkv, d).transpose(1, 2).to(q.dtype)  # (batch, kv_heads, max_len, dim)
        vi = vi.view(b, n, hkv, d).transpose(1, 2).to(q.dtype)
        # The query heads sharing a KV head become that head's "query rows": one
        # GQA decode step is an MQA-free (batch, kv_heads, group, dim) attention.
        qg = q.view(b, hkv, -1, d)
        ks, vs = self._scales(layer)
        o = F.scaled_dot_product_attention(qg, ki, vi, attn_mask=meta.decode_mask, scale=self.ctx.scaling * ks)
        return (o if vs == 1.0 else o * vs).reshape(b, -1, d)  # (batch, heads, dim)

    def _scales(self, layer: int) -> tuple[float, float]:
        """An fp8 pool's K and V scales (kvcache/kv_scales.py): K's folds into the softmax scale,
        V's into the output, so the gathered KV is only upcast, never rescaled."""
        s = self.ctx.kv_pool.scales
        return s.k[layer], s.v[layer]

    def _decode_kernel(self, q: torch.Tensor, layer: int, meta: _Metadata) -> torch.Tensor:
        pool = self.ctx.kv_pool
        kbuf, vbuf = pool.k_buffer(layer), pool.v_buffer(layer)  # (slots, kv_heads, dim)
        out = cpu_kernels.paged_decode_attention(
            q.to(kbuf.dtype), kbuf, vbuf, self.ctx.req_to_token_pool.req_to_token,
            meta.decode_rows, meta.decode_seq_lens, self.ctx.scaling,
        )
        return out.to(q.dtype)  # (batch, heads, dim)
