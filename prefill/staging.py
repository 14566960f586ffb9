"""SliceStaging: the prefill side of a head-slice send packed into whole pages.

Between TP sizes a send may move part of each token's heads (tandem/pd/transfer/head_map.py).
Sent where they lie, those bytes are one descriptor per (layer, K/V, token): measured at
0.006x of memcpy (docs/tp.md). Where the slice is every head the decode rank holds
(`Write.gather`: prefill TP 1 -> decode TP 2), this side gathers it first into a staging
buffer laid out as that decode rank's pages:

    pool      (layers, 2, pages, P, H, D)   heads [lo, hi) of pages src[0..n)
        | one strided copy per page run (torch: a CPU memcpy, a GPU kernel)
        v
    staged    (layers, 2, n + 1, P, w, D)   pages 1..n (0 stays the pad page of a KVLayout)

and the send moves staged pages 1..n into decode's pages as whole page runs: one descriptor
per (layer, K/V, run). The staged bytes are a KVLayout of their own (heads [lo, hi), n + 1
pages at the range's address), so pages.py builds the descriptors as for any whole-page send.

The staging buffer is one allocation of `capacity` bytes, made and registered with the
transfer agent on first use (a prefill that never meets another TP size holds none). Ranges
of it are held per chunk key until every write of that chunk is reported (RankSends releases
them, and starts the writes that waited for room, in order). A write larger than the whole
buffer, or any write when the buffer cannot be allocated, sends as slices: slower, never failed.

Size (staging_bytes): one prefill chunk at this rank's full width, which a chunk's writes to
every decode rank need together (more where decode replicates heads: those then take turns).
Outside the KV budget: on a GPU it comes out of the fixed slack the memory reserve keeps
(kv_memory.reserve_bytes), so it is capped at CUDA_CAP there; a model whose chunk is
wider sends its slices.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.pd.transfer.contract import KVTransfer, TransferError
from tandem.pd.transfer.pages import page_runs
from tandem.protocol.kv_layout import HeadRange, KVLayout

log = logging.getLogger(__name__)

ALIGN = 256  # range starts: any dtype's view, and the alignment copies run fastest at
CUDA_CAP = 256 << 20  # a quarter of the reserve's fixed 1 GiB on CUDA


class Ranges:
    """First-fit byte ranges of [0, capacity); few are live at once (chunks in flight)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used: list[tuple[int, int]] = []  # (start, end), sorted

    def take(self, n: int) -> int | None:
        start = 0
        for i, (a, b) in enumerate(self.used):
            if a - start >= n:
                self.used.insert(i, (start, start + n))
                return start
            start = -(-b // ALIGN) * ALIGN
        if self.capacity - start >= n:
            self.used.append((start, start + n))
            return start
        return None

    def free(self, start: int) -> None:
        self.used = [r for r in self.used if r[0] != start]


class SliceStaging:
    def __init__(self, pool: TokenToKVPool, transfer: KVTransfer, capacity: int) -> None:
        self.pool, self.transfer = pool, transfer
        self.layout = pool.layout()
        self.ranges = Ranges(capacity)
        self.buffer: torch.Tensor | None = None
        self.unavailable = capacity <= 0  # allocation or registration failed once: slices from then on
        self.held: dict[str, list[int]] = {}  # chunk key -> range starts
        self.stats = {"staged_sends": 0, "staged_bytes": 0}

    def _staged(self, pages: int, heads: HeadRange) -> KVLayout:
        """The layout of `pages` staged pages of `heads` (+ the pad page), at address 0."""
        lay = self.layout
        return KVLayout(num_layers=lay.num_layers, num_kv_heads=heads[1] - heads[0], head_dim=lay.head_dim,
                        dtype=lay.dtype, itemsize=lay.itemsize, page_size=lay.page_size, num_pages=pages + 1,
                        base_ptr=0, mem_type=lay.mem_type, device_id=lay.device_id, head_start=heads[0],
                        total_kv_heads=lay.total_heads)

    def fits(self, pages: int, heads: HeadRange) -> bool:
        """Whether such a write can ever be staged (the buffer empty): else it goes as slices."""
        return (not self.unavailable and self._staged(pages, heads).total_bytes <= self.ranges.capacity
                and self._buffer() is not None)

    def stage(self, key: str, pages: Sequence[int], heads: HeadRange) -> KVLayout | None:
        """Gather `heads` of `pages` into a staged layout (its pages 1..n), held under `key`;
        None when the buffer has no room now."""
        staged = self._staged(len(pages), heads)
        buffer = self._buffer()
        start = self.ranges.take(staged.total_bytes) if buffer is not None else None
        if buffer is None or start is None:
            return None
        self.held.setdefault(key, []).append(start)
        self._gather(buffer[start : start + staged.total_bytes], pages, heads, staged)
        self.stats["staged_sends"] += 1
        self.stats["staged_bytes"] += staged.total_bytes
        return KVLayout(**{**staged.to_dict(), "base_ptr": buffer.data_ptr() + start})

    def _gather(self, out: torch.Tensor, pages: Sequence[int], heads: HeadRange, staged: KVLayout) -> None:
        lay, P = self.layout, self.layout.page_size
        src = self.pool.kv_buffer.view(lay.num_layers, 2, lay.num_pages, P, lay.num_kv_heads, lay.head_dim)
        src = src[:, :, :, :, heads[0] - lay.head_start : heads[1] - lay.head_start]
        dst = out.view(self.pool.dtype).view(lay.num_layers, 2, staged.num_pages, P, staged.num_kv_heads, lay.head_dim)
        # Staged pages are consecutive, so each run of consecutive source pages is one copy.
        for s, d, n in page_runs(pages, range(1, len(pages) + 1)):
            dst[:, :, d : d + n].copy_(src[:, :, s : s + n])
        if out.is_cuda:  # NIXL reads the buffer outside any stream: the copies must have landed
            torch.cuda.current_stream(out.device).synchronize()

    def _buffer(self) -> torch.Tensor | None:
        if self.buffer is None and not self.unavailable:
            try:
                buffer = torch.empty(self.ranges.capacity, dtype=torch.uint8, device=self.pool.kv_buffer.device)
                self.transfer.add_staging(buffer.data_ptr(), buffer.numel())
                self.buffer = buffer
            except (torch.OutOfMemoryError, TransferError) as exc:
                self.unavailable = True
                log.warning("no staging buffer for head-slice sends (%s): they go as per-token slices", exc)
        return self.buffer

    def release(self, key: str) -> None:
        """Every write of chunk `key` is reported: its ranges are free."""
        for start in self.held.pop(key, []):
            self.ranges.free(start)

    def check_integrity(self) -> None:
        assert not self.held and not self.ranges.used, f"staging held while idle: {sorted(self.held)}"


def staging_bytes(layout: KVLayout, chunk_tokens: int) -> int:
    """One chunk at this rank's full width, with room for the pad page of each write and a
    send that starts mid-page (chunks end anywhere, sends at a page boundary)."""
    pages = -(-chunk_tokens // layout.page_size) + 1
    size = (pages + 1) * layout.page_bytes * 2 * layout.num_layers + 8 * ALIGN
    return min(size, CUDA_CAP) if layout.mem_type == "VRAM" else size
