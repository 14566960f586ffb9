"""DecodeGraphInputs: the static buffers every captured decode graph reads, and how a step fills them.

A CUDA graph replays the kernels it recorded against the memory addresses it saw at capture.
So every tensor a captured forward reads must live as long as the graph: a tensor made during
capture (say `torch.arange(bs)`) is freed after it, its memory reused, and every replay reads
whatever lands there. Hence one rule: a captured ForwardBatch is built only from views of the
buffers below, which the graph runner owns for the graphs' whole life; `check_views` enforces it.

A decode step's host work is the cost to keep small (docs/gpu.md: the host is the next bound once
the kernels are fused). So a step crosses to the device as ONE copy: the host writes every
per-row field into a host buffer (numpy, no torch op; pinned on CUDA) and one `copy_` moves it
into `packed`. Everything derived from it runs inside the graph (`prologue` / `epilogue`):

    packed (device, int64, FIELDS x max_bs)      in the graph
      INPUT  token ids, negative = future     -> input_ids: futures resolved from the ring
      POS    position of the new token        -> seq_lens = POS + 1 (int32, FlashInfer's)
      LOC    KV slot of the new token         -> req_to_token[ROW, POS] = LOC (a mirrored table)
      ROW    request row
      FUT    future slot this row's sample    <- next_ids = argmax(logits), stored into the ring
             is stored to (0: none)

At replay a batch of b rows runs in a bucket of B >= b rows; rows b..B-1 are padding:

    padding row: input 0, position 0 (seq_len 1), slot 0 (page 0), the table's scratch row, future slot 0

Page 0 is reserved in the KV pool and the scratch row is never handed out, so padded writes land
nowhere live and padded reads are of finite data; future slot 0 is never handed out either.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tandem.engine.forward_batch import ForwardBatch, ForwardMode

INPUT, POS, LOC, ROW, FUT = range(5)
FIELDS = 5


class DecodeGraphInputs:
    def __init__(self, max_bs: int, device: torch.device | str, scratch_row: int = 0) -> None:
        device = torch.device(device)
        self.max_bs, self.scratch_row = max_bs, scratch_row
        self.packed = torch.zeros((FIELDS, max_bs), dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)  # futures resolved
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        # Decode takes the logits of every row: row i's last (only) token is token i.
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.next_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)  # greedy samples
        self._cuda = device.type == "cuda"
        # Two host buffers in turn, each refilled only once its last copy has run (an event): the
        # host may fill step N+1 while step N's copy is still queued.
        self._stages = [torch.zeros((FIELDS, max_bs), dtype=torch.int64, pin_memory=self._cuda)
                        for _ in range(2 if device.type != "meta" else 0)]
        self._arrays = [s.numpy() for s in self._stages]  # made once: each .numpy() is two torch ops
        self._copied = [torch.cuda.Event() for _ in self._stages] if self._cuda else []
        self._recorded = [False, False]
        self._turn = 0
        self._batches: dict[int, ForwardBatch] = {}

    def buffers(self) -> list[torch.Tensor]:
        """What lives on the device for the graphs' life (runner/graph_memory.py counts it)."""
        return [self.packed, self.input_ids, self.seq_lens, self.logits_indices, self.next_ids]

    def batch(self, bs: int) -> ForwardBatch:
        """The static decode batch of bucket `bs`, one object per bucket; `fill` keeps its host
        lists (what the attention plan reads) in step with what the buffers hold."""
        if bs not in self._batches:
            p = self.packed
            self._batches[bs] = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=p[POS, :bs],
                out_cache_loc=p[LOC, :bs], req_pool_indices=p[ROW, :bs], req_pool_indices_cpu=[self.scratch_row] * bs,
                seq_lens=self.seq_lens[:bs], seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
                extend_lens_cpu=[1] * bs, num_extend_reqs=0, logits_indices=self.logits_indices[:bs],
            )
        return self._batches[bs]

    # ---- host side: one step's fields, one copy --------------------------------------------------
    def fill(self, bs: int, input_ids: np.ndarray, positions: np.ndarray, locs: np.ndarray, rows: np.ndarray,
             future_slots: range | None) -> ForwardBatch:
        """Write a step of b = len(rows) rows into the next host buffer, pad to bucket `bs`, and copy
        the buffer to the device; return the bucket's static batch, its host lists updated."""
        b = len(rows)
        stage, a = self._stages[self._turn], self._arrays[self._turn]
        if self._recorded[self._turn]:
            self._copied[self._turn].synchronize()
        a[INPUT, :b], a[POS, :b], a[LOC, :b], a[ROW, :b] = input_ids, positions, locs, rows
        a[FUT, :b] = np.arange(future_slots.start, future_slots.stop) if future_slots is not None else 0
        a[:, b:bs] = 0
        a[ROW, b:bs] = self.scratch_row
        self.packed.copy_(stage, non_blocking=True)
        if self._cuda:
            self._copied[self._turn].record()
            self._recorded[self._turn] = True
        self._turn ^= 1
        batch = self.batch(bs)
        seq = a[POS, :bs] + 1
        batch.seq_lens_cpu = seq.tolist()
        batch.prefix_lens_cpu = a[POS, :bs].tolist()
        batch.req_pool_indices_cpu = a[ROW, :bs].tolist()
        return batch

    # ---- device side: inside the graph ----------------------------------------------------------
    def prologue(self, bs: int, future_buf: torch.Tensor, table: torch.Tensor | None) -> None:
        """Captured before the forward: resolve futures, derive seq_lens, write the step's table
        cells (`table` is the device's req_to_token where the host keeps a mirror, else None:
        the host's write was the table's)."""
        p = self.packed
        ids = p[INPUT, :bs]
        self.input_ids[:bs].copy_(torch.where(ids < 0, future_buf[(-ids).clamp(min=0)], ids))
        self.seq_lens[:bs].copy_(p[POS, :bs] + 1)
        if table is not None:
            table[p[ROW, :bs], p[POS, :bs]] = p[LOC, :bs].to(table.dtype)

    def epilogue(self, bs: int, logits: torch.Tensor, future_buf: torch.Tensor) -> None:
        """Captured after the forward: the greedy sample of every row, stored into its future slot.
        A batch that samples otherwise (temperature, a grammar mask, logprobs) samples from the
        logits after the replay and stores its own ids over these (runner/model_worker.py)."""
        self.next_ids[:bs].copy_(logits.argmax(dim=-1))
        future_buf[self.packed[FUT, :bs]] = self.next_ids[:bs]

    def check_views(self, batch: ForwardBatch) -> None:
        """Raise unless every tensor of `batch` is a view of one of the buffers."""
        owned = {t.untyped_storage().data_ptr() for t in self.buffers()}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in owned:
                raise AssertionError(f"captured batch field {f.name!r} is not a view of a graph-owned buffer")
