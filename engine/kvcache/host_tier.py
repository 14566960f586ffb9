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

On CPU the host pool is a second pool in the same memory: every path runs and is tested here.
On CUDA it is pinned, and a copy waits for the device (it is synchronous in this release; the
issue's copy stream and layer-by-layer load are the next step, docs/engine.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.engine.engine_config import HICACHE_WRITE_POLICIES
from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.memory_pool import TokenToKVPool

WRITE_POLICIES = HICACHE_WRITE_POLICIES  # named beside the flag (engine_config.py), read here


@dataclass
class TierStats:
    """Counters since start, for /debug/pool and /metrics."""

    written_tokens: int = 0  # device -> host
    loaded_tokens: int = 0  # host -> device (each a prefill token saved)
    dropped_tokens: int = 0  # host pages freed to make room (LRU)
    load_seconds: float = 0.0  # time matches spent loading: what a step stalled for
    write_seconds: float = 0.0
    bytes_per_token: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"written_tokens": self.written_tokens, "loaded_tokens": self.loaded_tokens,
                "dropped_tokens": self.dropped_tokens, "load_seconds": round(self.load_seconds, 6),
                "write_seconds": round(self.write_seconds, 6),
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
        self.stats = TierStats(bytes_per_token=device_pool.bytes_per_token())

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_pages * self.page_size

    def used_tokens(self) -> int:
        return self.capacity_tokens - self.allocator.available_size()

    # ---- copies ----------------------------------------------------------------------
    def write(self, dev_slots: torch.Tensor) -> torch.Tensor | None:
        """Copy these whole device pages into new host pages; their host slots, or None when
        the host pool has no room (the caller frees host pages first)."""
        n = dev_slots.numel() // self.page_size
        pages = self.allocator.alloc_pages(n)
        if pages is None:
            return None
        t = time.perf_counter()
        self._pages(self.buffer)[:, :, pages] = self._pages(self.device_pool.kv_buffer)[:, :, self._page_ids(
            dev_slots)].to("cpu")
        self.stats.write_seconds += time.perf_counter() - t
        self.stats.written_tokens += n * self.page_size
        return self._slots(pages)

    def load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        """Copy host pages back into device pages the caller allocated."""
        t = time.perf_counter()
        dev = self._pages(self.device_pool.kv_buffer)
        dev[:, :, self._page_ids(dev_slots).to(dev.device)] = self._pages(self.buffer)[
            :, :, self._page_ids(host_slots)].to(dev.device)
        self.stats.load_seconds += time.perf_counter() - t
        self.stats.loaded_tokens += host_slots.numel()

    # ---- a page as bytes (the disk tier, disk_tier.py) -------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.stats.bytes_per_token * self.page_size

    def page_payload(self, slots: torch.Tensor, on_host: bool) -> bytes:
        """One page's K and V of every layer, from the host pool or the device pool."""
        buf = self.buffer if on_host else self.device_pool.kv_buffer
        page = int(self._page_ids(slots)[0])
        return self._pages(buf)[:, :, page].to("cpu").contiguous().numpy().tobytes()

    def load_payload(self, payload: bytes, dev_slots: torch.Tensor) -> None:
        """Write one page's bytes (page_payload's) into the device page holding `dev_slots`."""
        dev = self._pages(self.device_pool.kv_buffer)
        page = int(self._page_ids(dev_slots)[0])
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dev.shape[0], dev.shape[1], -1)
        dev[:, :, page] = src.to(dev.device)

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
