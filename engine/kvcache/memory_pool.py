"""The two KV memory pools of the seeds.

    ReqToTokenPool   request slot -> token positions -> KV slot index
    TokenToKVPool    KV slot index -> per-layer K and V vectors

A request owns one row of `req_to_token`; entry `[row, pos]` is the KV slot
holding the key/value of the request's token at position `pos`. The KV storage
is ONE contiguous tensor for all layers so that a transfer engine (NIXL) can
register it with a single call:

    kv_buffer: (num_layers, 2, num_slots, num_kv_heads, head_dim)
                            ^ 0 = K, 1 = V

Slot `s` lives in page `s // page_size`. Page 0 is never handed out: it is the
scratch target for padded writes (CUDA-graph padding) and the pad index for
gathers, so a stale or padded index can never corrupt a live request.
"""

from __future__ import annotations

import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.kvcache.allocator import PageAllocator
from tandem.protocol.kv_layout import KVLayout


class ReqToTokenPool:
    """Owns request slots: rows of the request -> KV-slot table.

    A freed row is *held*, not reusable, until `reclaim()`. Under overlap a request
    can finish while a launched batch still reads its row (the forward builds its page
    table from `req_to_token` on the worker thread); reusing the row at once would let
    the next batch's construction rewrite it under that forward. The scheduler reclaims
    at the start of each result it processes, when every batch launched before the
    frees has completed."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        # int32 because FlashInfer's page tables are int32 and it halves gather traffic.
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
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
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)

    def check_integrity(self, in_use: int | None = None) -> None:
        released = self._free + self._held
        assert len(set(released)) == len(released), "request slot freed twice"
        if in_use is not None:
            assert len(released) + in_use == self.size, (
                f"request slots leaked: free {len(released)} + in use {in_use} != {self.size}"
            )


class TokenToKVPool:
    """Owns the KV storage and the page allocator over it."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 2:
            raise ValueError("KV pool needs at least 2 pages (page 0 is reserved)")
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        # empty, not zeros: pages are written before they are read, and an untouched
        # CPU page costs no RAM. Page 0 (the pad target) must hold finite values.
        self.kv_buffer = torch.empty(
            (num_layers, 2, self.num_slots, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.kv_buffer[:, :, :page_size].zero_()
        self.allocator = PageAllocator(num_pages, page_size, device)
        # On CPU one fused call writes a layer's K and V (two index_copy_ cost ~45 us each at decode).
        self._fused_store = self.kv_buffer.device.type == "cpu" and cpu_kernels.enabled("store_kv")

    # ---- storage -----------------------------------------------------------------
    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.kv_buffer[layer, 0]  # (num_slots, kv_heads, head_dim), contiguous

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.kv_buffer[layer, 1]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._fused_store and k.dtype == self.dtype and v.dtype == self.dtype and loc.dtype == torch.int64:
            cpu_kernels.store_kv(self.kv_buffer[layer, 0], self.kv_buffer[layer, 1], loc.contiguous(), k, v)
            return
        self.kv_buffer[layer, 0].index_copy_(0, loc, k.to(self.dtype))
        self.kv_buffer[layer, 1].index_copy_(0, loc, v.to(self.dtype))

    def layout(self) -> KVLayout:
        """The buffer's layout and address, for a transfer agent (and the PD handshake)."""
        num_slots, kv_heads, head_dim = self.kv_buffer.shape[2:]
        return KVLayout(num_layers=self.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        dtype=str(self.dtype).removeprefix("torch."), itemsize=self.kv_buffer.element_size(),
                        page_size=self.page_size, num_pages=num_slots // self.page_size,
                        base_ptr=self.kv_buffer.data_ptr())

    def page_bytes_per_layer(self) -> int:
        """Bytes of one page of K (or V) in one layer: the unit a transfer moves."""
        return self.page_size * self.kv_buffer[0, 0, 0].numel() * self.kv_buffer.element_size()

    # ---- allocation (delegated) ------------------------------------------------------
    def available_size(self) -> int:
        return self.allocator.available_size()

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_pages * self.page_size

    def check_integrity(self, in_use_pages: int | None = None) -> None:
        self.allocator.check_integrity(in_use_pages)
