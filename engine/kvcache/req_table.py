"""ReqToTokenPool: the request-row table, request slot -> token position -> KV slot index.

A request owns one row of `req_to_token`; entry `[row, pos]` is the KV slot holding
the key/value of the request's token at position `pos`. One owner allocates and frees
rows: the cache manager (scheduler/cache_manager.py). The prefix caches read and write
a row's entries, never its ownership.
"""

from __future__ import annotations

import numpy as np
import torch


class ReqToTokenPool:
    """Owns request slots: rows of the request -> KV-slot table.

    A freed row is *held*, not reusable, until `reclaim()`. Under overlap a request
    can finish while a launched batch still reads its row (the forward builds its page
    table from `req_to_token` on the worker thread); reusing the row at once would let
    the next batch's construction rewrite it under that forward. The scheduler reclaims
    at the start of each result it processes, when every batch launched before the
    frees has completed, and whenever no batch is in flight (a failed batch has no result
    to process). Admission counts only free rows, so a held row delays a request, never
    fails it."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str,
                 host_mirror: bool | None = None) -> None:
        self.size = size
        self.max_context_len = max_context_len
        # One row past the handed-out ones, never allocated and all zeros (KV page 0, reserved):
        # the padded rows of a graph-captured decode batch read and write it (runner/graph_inputs.py).
        self.scratch_row = size
        # int32 because FlashInfer's page tables are int32 and it halves gather traffic.
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        # The scheduler reads rows on the host (a request's last slot every decode step, its
        # slots when it finishes); from a GPU table each read would stall on the device. So off
        # the CPU the host keeps a mirror, written with every write, and reads go to it. Slots
        # reach the table from the allocator and from mirror rows: host tensors, never a sync.
        mirror = torch.device(device).type != "cpu" if host_mirror is None else host_mirror
        self.host = torch.zeros((size + 1, max_context_len), dtype=torch.int32) if mirror else self.req_to_token
        self.mirrored = self.host is not self.req_to_token
        self.host_np = self.host.numpy()  # the scheduler's per-step reads and writes: numpy, no torch op
        self._next_check_row = 0
        self._free: list[int] = list(range(size))
        self._held: list[int] = []

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        rows, self._free = self._free[:n], self._free[n:]
        return rows

    def free(self, row: int) -> None:
        if not 0 <= row < self.size or row in self._free or row in self._held:
            raise ValueError(f"double free or bad request slot {row}")
        self._held.append(row)

    def reclaim(self) -> None:
        """Make held rows allocatable: no batch that could read them is still running."""
        self._free.extend(self._held)
        self._held.clear()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """req_to_token[row, start : start + len(slots)] = slots, on the device and the host."""
        host = slots.to("cpu", torch.int32)
        self.host[row, start : start + host.numel()] = host
        if self.mirrored:
            # non_blocking: a pageable source is staged at once, and the forward's stream waits
            # for this one at launch (model_worker.StreamHandoff)
            self.req_to_token[row, start : start + host.numel()] = host.to(self.req_to_token.device, non_blocking=True)

    def write_decode_cells(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] for one decode step, on the host. On a mirrored
        table the device's cells are written by the forward that decodes them
        (ModelRunner.write_decode_cells): it has rows, positions and slots on the device already,
        so the step costs no copy of its own, and under CUDA graphs no host op at all."""
        self.host_np[rows, cols] = slots

    def sync_rows(self, rows: list[int]) -> None:
        """The device's copy of `rows` from the mirror: after a decode batch failed, its forward
        may not have written its cells (rare; a few rows)."""
        if self.mirrored and rows:
            idx = torch.tensor(rows, dtype=torch.int64)
            self.req_to_token[idx.to(self.req_to_token.device)] = self.host[idx].to(self.req_to_token.device)

    def _check_mirror(self, max_bytes: int = 64 << 20) -> None:
        """The mirror equals the table: all of it when that is small, else 8 rows in turn per
        call (a whole GPU table can be hundreds of MB to copy back, and this runs on each idle)."""
        start, stop = 0, self.size
        if self.host.numel() * 4 > max_bytes:
            start, stop = self._next_check_row, min(self._next_check_row + 8, self.size)
            self._next_check_row = stop % self.size
        # invariant: the idle integrity check's own report
        assert torch.equal(self.host[start:stop], self.req_to_token[start:stop].cpu()), (
            "host mirror differs from req_to_token")

    def check_integrity(self, in_use: int | None = None) -> None:
        if self.mirrored:
            self._check_mirror()
        released = self._free + self._held
        assert len(set(released)) == len(released), "request slot freed twice"
        if in_use is not None:
            assert len(released) + in_use == self.size, (
                f"request slots leaked: free {len(released)} + in use {in_use} != {self.size}"
            )
