"""KVLayout: one worker's KV buffer as a transfer agent sees it, torch-free.

The buffer is one contiguous allocation (engine/kvcache/memory_pool.py):

    (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)     2: K then V

so a page of one layer's K (or V) is `page_bytes` contiguous bytes at

    base_ptr + layer * layer_stride + kv * kv_stride + page * page_bytes

and within it token t's slot is `slot_bytes` at + t * slot_bytes: its heads, each head_dim
elements. Under tensor parallelism a buffer holds a range of the model's `total_kv_heads`:
heads [head_start, head_start + num_kv_heads) (`heads`), so the model's head h sits at
+ (h - head_start) * head_bytes in a slot. Without TP the range is all of them.

The buffer lives in host memory ("DRAM", device_id 0) or on a GPU ("VRAM", device_id = the
CUDA ordinal in the owner's process): a transfer agent registers it, and describes the peer's
pages, with the owner's memory type and device, never its own.

Prefill and decode exchange their layouts in the PD handshake: two workers can move
pages between them only if `mismatch()` finds nothing (the page counts, devices and the
head ranges may differ; which heads go where is tandem/pd/transfer/head_map.py's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

HeadRange = tuple[int, int]  # [first, end) of the model's KV heads
Run = tuple[int, int, int]  # (first source page, first destination page, pages)


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Source page src[i] goes to destination page dst[i]: the runs consecutive on both sides,
    each moved (or copied) as one piece instead of page by page."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    runs: list[Run] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def shard_heads(total: int, tp_size: int, rank: int) -> HeadRange:
    """The KV heads TP rank `rank` of `tp_size` holds: a block when tp_size divides them, else
    (tp_size a multiple of them) the one head its query heads read, replicated. The engine
    sizes its pools by this (engine/parallel/shard.py) and PD plans its writes by it."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside TP size {tp_size}")
    if total % tp_size == 0:
        per = total // tp_size
        return rank * per, (rank + 1) * per
    if tp_size % total == 0:
        head = rank // (tp_size // total)
        return head, head + 1
    raise ValueError(f"{total} KV heads cannot be split over TP size {tp_size}")


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
    head_start: int = 0  # the first of the model's KV heads held here (tensor parallelism)
    total_kv_heads: int = 0  # the model's KV heads; 0: num_kv_heads (no TP, the pre-v3 dicts)

    def __post_init__(self) -> None:
        if not (self.num_kv_heads > 0 and 0 <= self.head_start
                and self.head_start + self.num_kv_heads <= self.total_heads):
            raise ValueError(f"KV heads [{self.head_start}, {self.head_start + self.num_kv_heads}) "
                             f"outside the model's {self.total_heads}")
        if self.base_ptr + self.total_bytes > 2**64:  # a peer's: its addresses must fit NIXL's uint64
            raise ValueError("the KV buffer reaches past the 64-bit address space")

    @property
    def total_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def heads(self) -> HeadRange:
        """The model's KV heads this buffer holds."""
        return self.head_start, self.head_start + self.num_kv_heads

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.itemsize

    @property
    def slot_bytes(self) -> int:
        """One token of one layer's K (or V): every head held here."""
        return self.num_kv_heads * self.head_bytes

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

    def slices_per_page(self, heads: HeadRange) -> int:
        """k: how many pages of `heads` alone one page of this buffer holds (sliced())."""
        width = heads[1] - heads[0]
        if not (0 < width <= self.num_kv_heads and self.num_kv_heads % width == 0 and 0 <= heads[0]
                and heads[1] <= self.total_heads):
            raise ValueError(f"KV heads [{heads[0]}, {heads[1]}) do not divide this buffer's {self.num_kv_heads}")
        return self.num_kv_heads // width

    def sliced(self, heads: HeadRange) -> KVLayout:
        """This buffer seen as pages of `heads` alone, as a PD role stages a head slice
        (prefill/staging.py): each of its pages holds k = slices_per_page(heads) such pages,
        page v at the (v % k)-th k-th of page v // k, in every layer and K/V. Same bytes, same
        address range; what the staged pages hold is the slice, packed."""
        k = self.slices_per_page(heads)
        return replace(self, num_kv_heads=heads[1] - heads[0], head_start=heads[0], total_kv_heads=self.total_heads,
                       num_pages=self.num_pages * k)

    def mismatch(self, other: KVLayout) -> list[str]:
        """What stops pages of `self` from being written into `other` as they are. Memory types
        must match: host-to-GPU needs a UCX built with CUDA on both ends and crosses PCIe per
        page, no deployment of ours pairs them, and a pair that passed here would fail every
        transfer instead of its handshake. The head ranges may differ (tensor parallelism of
        another size): a send names the heads it moves; the model's head count may not."""
        keys = ("num_layers", "total_heads", "head_dim", "dtype", "itemsize", "page_size", "mem_type")
        return [f"{k}: {getattr(self, k)} != {getattr(other, k)}"
                for k in keys if getattr(self, k) != getattr(other, k)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
