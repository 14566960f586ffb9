"""DecodeGraphInputs: the static buffers every captured decode graph reads.

A CUDA graph replays the kernels it recorded against the memory addresses it saw
at capture. So every tensor a captured forward reads must live as long as the
graph: a tensor made during capture (say `torch.arange(bs)`) is freed after it,
its memory reused, and every replay reads whatever lands there. Hence one rule:
a captured ForwardBatch is built only from views of the buffers below, which the
graph runner owns for the graphs' whole life; `check_views` enforces it, and the
tests call it on every bucket without a GPU.

At replay a batch of b rows runs in a bucket of B >= b rows; rows b..B-1 are padding:

    padding row: req_pool_index 0, seq_len 1, position 0, out_cache_loc 0 (page 0)

Page 0 is reserved in the KV pool, so padded writes land nowhere live, and padded
reads are of finite data; padded logits are never returned.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.engine.forward_batch import ForwardBatch, ForwardMode


class DecodeGraphInputs:
    def __init__(self, max_bs: int, device: torch.device | str) -> None:
        z = lambda dtype: torch.zeros(max_bs, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = z(torch.int64)
        self.positions = z(torch.int64)
        self.out_cache_loc = z(torch.int64)
        self.req_pool_indices = z(torch.int64)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        # Decode takes the logits of every row: row i's last (only) token is token i.
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)

    def buffers(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices, self.seq_lens,
                self.logits_indices]

    def batch(self, bs: int, rows: list[int], seq_lens_cpu: list[int]) -> ForwardBatch:
        """The decode batch of bucket `bs` over the static buffers; the host lists say what the
        buffers hold (the attention plan reads them), they are not read by the graph."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            req_pool_indices_cpu=rows, seq_lens=self.seq_lens[:bs], seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=[s - 1 for s in seq_lens_cpu], extend_lens_cpu=[1] * bs,
            num_extend_reqs=0, logits_indices=self.logits_indices[:bs],
        )

    def load(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """Copy `batch` (b rows) into the buffers, pad to bucket `bs`, return the static batch."""
        b = batch.batch_size
        for dst, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                         (self.out_cache_loc, batch.out_cache_loc),
                         (self.req_pool_indices, batch.req_pool_indices), (self.seq_lens, batch.seq_lens)):
            dst[:b].copy_(src, non_blocking=True)
        if bs > b:
            for t in (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices):
                t[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
        pad = bs - b
        return self.batch(bs, batch.req_pool_indices_cpu + [0] * pad, batch.seq_lens_cpu + [1] * pad)

    def check_views(self, batch: ForwardBatch) -> None:
        """Raise unless every tensor of `batch` is a view of one of the buffers."""
        owned = {t.untyped_storage().data_ptr() for t in self.buffers()}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in owned:
                raise AssertionError(f"captured batch field {f.name!r} is not a view of a graph-owned buffer")
