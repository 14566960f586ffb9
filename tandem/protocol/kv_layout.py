"""KVLayout: one worker's KV buffer as a transfer agent sees it, torch-free.

The buffer is one contiguous allocation (engine/kvcache/memory_pool.py):

    (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)     2: K then V

so a page of one layer's K (or V) is `page_bytes` contiguous bytes at

    base_ptr + layer * layer_stride + kv * kv_stride + page * page_bytes

The buffer lives in host memory ("DRAM", device_id 0) or on a GPU ("VRAM", device_id = the
CUDA ordinal in the owner's process): a transfer agent registers it, and describes the peer's
pages, with the owner's memory type and device, never its own.

Prefill and decode exchange their layouts in the PD handshake: two workers can move
pages between them only if `mismatch()` finds nothing (the page counts and devices may differ).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # e.g. "bfloat16"
    itemsize: int  # bytes per element
    page_size: int  # tokens per page
    num_pages: int  # page 0 included (reserved: the pad target)
    base_ptr: int  # address of the buffer's first byte
    mem_type: str = "DRAM"  # NIXL's memory type: "DRAM" (host) or "VRAM" (GPU)
    device_id: int = 0  # the GPU's ordinal in the owner's process; 0 for DRAM

    @property
    def slot_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """One page of one layer's K (or V): the unit a transfer moves."""
        return self.page_size * self.slot_bytes

    @property
    def kv_stride(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def layer_stride(self) -> int:
        return 2 * self.kv_stride

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_stride

    def page_addr(self, layer: int, kv: int, page: int) -> int:
        if not (0 <= layer < self.num_layers and kv in (0, 1) and 0 <= page < self.num_pages):
            raise IndexError(f"page ({layer}, {kv}, {page}) outside the layout")
        return self.base_ptr + layer * self.layer_stride + kv * self.kv_stride + page * self.page_bytes

    def mismatch(self, other: KVLayout) -> list[str]:
        """What stops pages of `self` from being written into `other` as they are. Memory types
        must match: host-to-GPU needs a UCX built with CUDA on both ends and crosses PCIe per
        page, no deployment of ours pairs them, and a pair that passed here would fail every
        transfer instead of its handshake."""
        keys = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "mem_type")
        return [f"{k}: {getattr(self, k)} != {getattr(other, k)}"
                for k in keys if getattr(self, k) != getattr(other, k)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
