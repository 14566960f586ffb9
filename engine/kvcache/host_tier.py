"""The host tier under the radix cache: a second KV pool in host memory that holds what the
device pool evicts, so a prefix that fell out of the device comes back by a copy instead of a
prefill (SGLang's HiCache, `--enable-hierarchical-cache`).

    device pool (kv_memory.py)  <-- load(host -> device), at a match --+
        |                                                              |
        +-- write(device -> host): at eviction (write_back), or when   |
            the cache takes a page (write_through)  -->  host pool ----+

The tier owns its pool and its page allocator; the radix cache owns which node holds which
host pages (radix_cache.py: a node is on the device, on the host, or on both). Pages move as
whole pages, every layer's K and V at once, as bytes (so an fp8 pool moves as it is).

Every copy is queued on the tier's TierCopies (tier_copies.py) and runs off the scheduler's
thread, layer by layer, when the next batch launches; that batch's forward waits for each layer
before touching it. On CPU the host pool is a second pool in the same memory and a thread copies:
every path runs and is tested here. On CUDA it is pinned, and a side stream copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.engine.engine_config import HICACHE_WRITE_POLICIES
from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.tier_copies import CopyJob, CopyOp, TierCopies, from_payloads, staging, tier_copies

WRITE_POLICIES = HICACHE_WRITE_POLICIES  # named beside the flag (engine_config.py), read here


@dataclass
class TierStats:
    """Counters since start, for /debug/pool and /metrics."""

    written_tokens: int = 0  # device -> host
    loaded_tokens: int = 0  # host -> device (each a prefill token saved)
    dropped_tokens: int = 0  # host pages freed to make room (LRU)
    bytes_per_token: int = 0
    copies: TierCopies | None = field(default=None, repr=False)  # its copy times and stalls

    def as_dict(self) -> dict[str, float | int]:
        c = self.copies
        seconds = c.seconds if c is not None else {}
        return {"written_tokens": self.written_tokens, "loaded_tokens": self.loaded_tokens,
                "dropped_tokens": self.dropped_tokens,
                # the copier's time each way (off the scheduler's thread), and what forwards
                # waited for a layer still loading: the stall the layer-by-layer load leaves
                "load_seconds": round(seconds.get("load", 0.0), 6),
                "write_seconds": round(seconds.get("write", 0.0) + seconds.get("spill", 0.0), 6),
                "stall_seconds": round(c.stall_seconds if c is not None else 0.0, 6),
                "written_bytes": self.written_tokens * self.bytes_per_token,
                "loaded_bytes": self.loaded_tokens * self.bytes_per_token}


def host_tokens(device_pool: TokenToKVPool, ratio: float, size_gib: float) -> int:
    """The host pool's size: `size_gib` GiB when set, else `ratio` times the device pool."""
    if size_gib > 0:
        return int(size_gib * 2**30) // device_pool.bytes_per_token()
    return int(device_pool.capacity_tokens * ratio)


class HostTier:
    def __init__(self, device_pool: TokenToKVPool, tokens: int, write_policy: str = "write_through") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        P = device_pool.page_size
        pages = tokens // P + 1  # +1: page 0 is the allocator's reserved page, as on the device
        if pages < 2:
            raise ValueError(f"the host tier needs at least one page ({P} tokens), got {tokens} tokens")
        self.device_pool = device_pool
        self.page_size = P
        self.write_through = write_policy == "write_through"
        dev = device_pool.kv_buffer
        L, two = dev.shape[:2]
        self.buffer = torch.empty((L, two, pages * P, *dev.shape[3:]), dtype=dev.dtype, device="cpu",
                                  pin_memory=dev.device.type == "cuda")
        self.allocator = PageAllocator(pages, P, "cpu")
        self.layers = L
        self.pinned = dev.device.type == "cuda"
        self.copies = tier_copies(L, dev.device)
        self.stats = TierStats(bytes_per_token=device_pool.bytes_per_token(), copies=self.copies)
        self._dev_pages = self._pages(dev)
        self._host_pages = self._pages(self.buffer)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_pages * self.page_size

    def used_tokens(self) -> int:
        return self.capacity_tokens - self.allocator.available_size()

    # ---- copies (queued: tier_copies.py) ---------------------------------------------------
    def write(self, dev_slots: torch.Tensor) -> torch.Tensor | None:
        """Copy these whole device pages into new host pages; their host slots, or None when
        the host pool has no room (the caller frees host pages first)."""
        n = dev_slots.numel() // self.page_size
        pages = self.allocator.alloc_pages(n)
        if pages is None:
            return None
        self.copies.add(CopyOp(self._dev_pages, self._page_ids(dev_slots).tolist(), self._host_pages,
                               pages.tolist(), "write"))
        self.stats.written_tokens += n * self.page_size
        return self._slots(pages)

    def load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        """Copy host pages back into device pages the caller allocated."""
        self.copies.add(CopyOp(self._host_pages, self._page_ids(host_slots).tolist(), self._dev_pages,
                               self._page_ids(dev_slots).tolist(), "load"))
        self.stats.loaded_tokens += host_slots.numel()

    def launch(self) -> CopyJob | None:
        """Start the queued copies; what a forward launched now waits on, layer by layer."""
        return self.copies.launch()

    def drain(self) -> None:
        """Every queued copy done: the device pages are the caller's to hand on."""
        self.copies.drain()

    def close(self) -> None:
        self.copies.close()

    # ---- pages as bytes (the disk tier, disk_tier.py) ---------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.stats.bytes_per_token * self.page_size

    def spill(self, slots: torch.Tensor, on_host: bool, put: Callable[[list[bytes]], None]) -> None:
        """Queue a copy of these pages (from the host pool, or the device pool) to a staging
        buffer; `put` gets each page's bytes (every layer's K and V) once it is done."""
        n = slots.numel() // self.page_size
        buf = staging(self.layers, n, self._dev_pages.shape[-1], self.pinned)
        src = self._host_pages if on_host else self._dev_pages
        self.copies.add(CopyOp(src, self._page_ids(slots).tolist(), buf, list(range(n)), "spill",
                               then=lambda: put([buf[:, :, i].contiguous().numpy().tobytes() for i in range(n)])))

    def load_payloads(self, payloads: Sequence[bytes], dev_slots: torch.Tensor) -> None:
        """Queue page payloads (spill's bytes, from the disk tier) into the device pages holding
        `dev_slots`, one page each."""
        buf = from_payloads(payloads, self.layers, self.pinned)
        self.copies.add(CopyOp(buf, list(range(len(payloads))), self._dev_pages,
                               self._page_ids(dev_slots).tolist(), "load"))

    def free(self, host_slots: torch.Tensor, dropped: bool = True) -> None:
        self.allocator.free(host_slots)
        if dropped:
            self.stats.dropped_tokens += host_slots.numel()

    # ---- layout ----------------------------------------------------------------------
    def _pages(self, buf: torch.Tensor) -> torch.Tensor:
        """(layers, 2, pages, bytes of a page): a page of every layer's K and V, as bytes."""
        L, two, slots = buf.shape[:3]
        return buf.view(torch.uint8).view(L, two, slots // self.page_size, -1)

    def _page_ids(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.reshape(-1, self.page_size)[:, 0].to("cpu", torch.int64) // self.page_size

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
