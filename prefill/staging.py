"""SliceStaging: the prefill side of a head-slice send, packed into whole pages.

Between TP sizes a send may move part of each token's heads (tandem/pd/transfer/head_map.py).
Sent where they lie, those bytes are one descriptor per (layer, K/V, token): measured at
0.006x of memcpy (docs/tp.md). Where the slice is every head the decode rank holds
(`Write.gather`: prefill TP 1 -> decode TP 2), this side first gathers it into staging pages
laid out as that decode rank's pages, and sends those as whole page runs.

The staging pages are pages of this rank's own KV pool, taken like a request's (evicting
cached prefixes if need be) and freed once the chunk is done on every rank: counted in the
KV budget, already registered with the transfer agent, no buffer of their own. Seen at the
slice's width (KVLayout.sliced) each pool page holds k = heads held / slice width staged
pages, so a chunk of n pages takes ceil(n / k) pool pages, consecutive or not:

    pool  (layers, 2, pages, P, H, D)         heads [lo, hi) of source pages src[0..n)
        | copy_pages (engine/kvcache/page_copy.py): one strided copy per run
        v
    view  (layers, 2, pages * k, P, w, D)     staged pages staged_pages(pool pages, 0, n, k)

A write whose staging finds the pool full waits (prefill/rank_sends.py) until earlier
chunks free theirs; with none other in flight, or larger than the whole pool, it goes as
slices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.kvcache.page_copy import copy_pages
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.pd.transfer.pages import staged_pages
from tandem.protocol.kv_layout import HeadRange, KVLayout


class SliceStaging:
    def __init__(self, cache: CacheManager) -> None:
        self.cache, self.pool = cache, cache.kv_pool
        self.layout = self.pool.layout()
        self.held: dict[str, list[int]] = {}  # chunk key -> the pool pages staging its writes
        self.stats = {"staged_sends": 0, "staged_pages": 0}

    def fits(self, pages: int, heads: HeadRange) -> bool:
        """Whether `pages` pages of `heads` can ever be staged (the pool empty): else slices."""
        return -(-pages // self.layout.slices_per_page(heads)) <= self.pool.capacity_tokens // self.layout.page_size

    def stage(self, key: str, pages: Sequence[int], heads: HeadRange) -> tuple[KVLayout, list[int]] | None:
        """Gather `heads` of `pages` into staging pages held under `key` (the chunk's):
        (this buffer seen at the slice's width, the staged pages in it, in the order of
        `pages`); None when the pool has no room now."""
        k = self.layout.slices_per_page(heads)
        got = self.cache.alloc_staging(-(-len(pages) // k))
        if got is None:
            return None
        self.held.setdefault(key, []).extend(got)
        staged = staged_pages(got, 0, len(pages), k)
        self._gather(pages, staged, heads, k)
        self.stats["staged_sends"] += 1
        self.stats["staged_pages"] += len(got)
        return self.layout.sliced(heads), staged

    def _gather(self, pages: Sequence[int], staged: list[int], heads: HeadRange, k: int) -> None:
        lay, buf = self.layout, self.pool.kv_buffer
        L, P, D = lay.num_layers, lay.page_size, lay.head_dim
        lo, hi = heads[0] - lay.head_start, heads[1] - lay.head_start
        src = buf.view(L, 2, lay.num_pages, P, lay.num_kv_heads, D)[:, :, :, :, lo:hi]
        view = buf.view(L, 2, lay.num_pages * k, P, hi - lo, D)  # the pool at the slice's width
        copy_pages(view, staged, src, pages)
        if buf.is_cuda:  # NIXL reads outside any stream: the gather must have landed
            torch.cuda.current_stream(buf.device).synchronize()

    def release(self, key: str) -> None:
        """Chunk `key` is done on every rank: its staging pages are free."""
        self.cache.free_staging(self.held.pop(key, []))

    def check_integrity(self) -> None:
        # The idle self-check's language (as the engine's pools): only this process's bugs fail it.
        assert not self.held, f"staging pages held while idle: {sorted(self.held)}"
