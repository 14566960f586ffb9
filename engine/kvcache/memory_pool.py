"""The KV store, SGLang's TokenToKVPool: KV slot index -> per-layer K and V vectors.
(The request -> slot table beside it is req_table.py.)

The KV storage is ONE contiguous tensor for all layers so that a transfer engine (NIXL) can
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
from tandem.engine.kvcache import kv_store_triton
from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.kv_scales import KVScales
from tandem.protocol.kv_layout import KVLayout


def memory_of(t: torch.Tensor) -> dict[str, str | int]:
    """NIXL's description of where `t` lives: host memory, or GPU memory on its device."""
    device = t.get_device()  # -1 on the host, the CUDA ordinal on a GPU (as nixl's own helper reads it)
    return {"mem_type": "DRAM", "device_id": 0} if device < 0 else {"mem_type": "VRAM", "device_id": device}


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under a CPU tensor (THP in `madvise` mode, the
    usual default). A KV transfer between processes runs through the kernel (UCX's CMA,
    process_vm_writev), which pins and copies page by page: with 2 MiB pages NIXL moved
    11.3 instead of 6.8 GB/s (docs/pd.md). A no-op off Linux or where madvise refuses."""
    import ctypes
    import ctypes.util
    import sys

    if sys.platform != "linux":
        return False
    huge = 2 * 2**20
    start = -(-t.data_ptr() // huge) * huge  # the 2 MiB-aligned interior of the buffer
    end = (t.data_ptr() + t.numel() * t.element_size()) // huge * huge
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14) == 0  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        return False


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
        heads: tuple[int, int] | None = None,
        total_kv_heads: int = 0,
        scales: KVScales | None = None,
    ) -> None:
        """`heads`/`total_kv_heads`: under tensor parallelism, which of the model's KV heads
        this rank's pool holds (its layout says so to a PD peer); None: all of them.
        `scales`: an fp8 pool's per-layer K and V scales (kv_scales.py); None: all 1.0."""
        if num_pages < 2:
            raise ValueError("KV pool needs at least 2 pages (page 0 is reserved)")
        self.page_size = page_size
        self.num_layers = num_layers
        self.head_start, self.total_kv_heads = (heads[0], total_kv_heads) if heads is not None else (0, 0)
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.scales = scales or KVScales.ones(num_layers)
        if not self.scales.unit and torch.tensor([], dtype=dtype).element_size() != 1:
            raise ValueError("KV scales are for an fp8 pool; this one stores " + str(dtype))
        # empty, not zeros: pages are written before they are read, and an untouched
        # CPU page costs no RAM. Page 0 (the pad target) must hold finite values.
        self.kv_buffer = torch.empty(
            (num_layers, 2, self.num_slots, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        if self.kv_buffer.device.type == "cpu":
            advise_huge_pages(self.kv_buffer)  # before the first touch below
        self.kv_buffer[:, :, :page_size].zero_()
        self.allocator = PageAllocator(num_pages, page_size, device)
        # One launch writes a layer's K and V: on CPU the fused kernel (two index_copy_ cost ~45 us
        # each at decode), on CUDA a Triton one (kv_store_triton.py).
        cpu = self.kv_buffer.device.type == "cpu"
        self._store = (cpu_kernels.store_kv if cpu and cpu_kernels.enabled("store_kv")
                       else kv_store_triton.store_kv if kv_store_triton.available(self.kv_buffer.device) else None)

    # ---- storage -----------------------------------------------------------------
    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.kv_buffer[layer, 0]  # (num_slots, kv_heads, head_dim), contiguous

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.kv_buffer[layer, 1]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if (self._store is not None and k.dtype == v.dtype == self.dtype and loc.dtype == torch.int64
                and kv_store_triton.rows_are_dense(k) and kv_store_triton.rows_are_dense(v)):
            self._store(self.kv_buffer[layer, 0], self.kv_buffer[layer, 1], loc.contiguous(), k, v)
            return
        if self.kv_buffer.element_size() == 1:  # fp8: torch's CPU index_copy_ takes its bytes only
            ks, vs = self.scales.k[layer], self.scales.v[layer]
            k, v = (k if ks == 1.0 else k.float() / ks), (v if vs == 1.0 else v.float() / vs)
            self.kv_buffer[layer, 0].view(torch.uint8).index_copy_(0, loc, k.to(self.dtype).view(torch.uint8))
            self.kv_buffer[layer, 1].view(torch.uint8).index_copy_(0, loc, v.to(self.dtype).view(torch.uint8))
            return
        self.kv_buffer[layer, 0].index_copy_(0, loc, k.to(self.dtype))
        self.kv_buffer[layer, 1].index_copy_(0, loc, v.to(self.dtype))

    def layout(self) -> KVLayout:
        """The buffer's layout and address, for a transfer agent (and the PD handshake)."""
        num_slots, kv_heads, head_dim = self.kv_buffer.shape[2:]
        return KVLayout(num_layers=self.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        dtype=str(self.dtype).removeprefix("torch."), itemsize=self.kv_buffer.element_size(),
                        page_size=self.page_size, num_pages=num_slots // self.page_size,
                        base_ptr=self.kv_buffer.data_ptr(), head_start=self.head_start,
                        total_kv_heads=self.total_kv_heads, **memory_of(self.kv_buffer))

    def bytes_per_token(self) -> int:
        """A token's K and V in every layer."""
        return self.num_layers * 2 * self.kv_buffer[0, 0, 0].numel() * self.kv_buffer.element_size()

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
