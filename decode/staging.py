"""ScatterStaging: the decode side of head slices it holds more of than a prefill rank.

Between TP sizes where a decode rank holds more KV heads than the prefill ranks writing it
(prefill TP 2 -> decode TP 1), each prefill rank's slice is every head it holds but part of
each of decode's slots: sent where they lie, one descriptor per (layer, K/V, token). Instead
decode reserves staging pages for each such write (head_map.Write.scatter) beside the room's
pages, and names them in KVDest.staging; prefill writes its whole pages there, seen at the
slice's width (KVLayout.sliced: k = decode heads / slice width staged pages per pool page),
and once the room has arrived decode moves them into the room's pages and frees them:

    staged  (layers, 2, pages * k, P, w, D)    staged_pages(staging pages, 0, n, k)
        | one strided copy per run (a scatter into the heads [lo, hi) of each slot)
        v
    pool    (layers, 2, pages, P, H, D)        the room's pages

Staging pages are pool pages, reserved and accounted with the room's own (every decode rank
alike: they allocate in lockstep) and freed with them on every way out. A room whose staging
could never fit beside it is sent as slices (KVDest.staging empty).
"""

from __future__ import annotations

from tandem.engine.kvcache.page_copy import copy_pages
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.pd.parts import Link
from tandem.pd.transfer.head_map import Staging
from tandem.pd.transfer.pages import staged_pages


class ScatterStaging:
    def __init__(self, cache: CacheManager) -> None:
        self.cache, self.pool = cache, cache.kv_pool
        self.layout = self.pool.layout()
        self.stats = {"scattered_rooms": 0, "unstaged_rooms": 0}

    def pages_needed(self, staging: Staging, pages: int) -> int:
        """Pool pages a room of `pages` pages stages in (0: nothing to stage, or it could never
        fit beside the room in this pool: its slices go as they lie)."""
        need = staging.writes * staging.pool_pages(pages)
        return 0 if need + pages > self.pool.capacity_tokens // self.layout.page_size else need

    def reserve(self, staging: Staging, pages: int) -> list[list[int]]:
        """The staging pages for a room, one list per scatter write (the caller counted
        pages_needed in the room's budget); none, and slices, where the pool still falls short."""
        lists: list[list[int]] = []
        for _ in range(staging.writes if self.pages_needed(staging, pages) else 0):
            got = self.cache.alloc_staging(staging.pool_pages(pages))
            if got is None:
                self.free(lists)
                lists = []
                break
            lists.append(got)
        self.stats["unstaged_rooms"] += staging.writes > 0 and not lists
        return lists

    def scatter(self, link: Link, staging: list[list[int]], pages: list[int]) -> None:
        """Move every scatter write's staged pages into the room's `pages`, in their heads."""
        lay, buf = self.layout, self.pool.kv_buffer
        L, P, D = lay.num_layers, lay.page_size, lay.head_dim
        pool = buf.view(L, 2, lay.num_pages, P, lay.num_kv_heads, D)
        for w in link.writes:
            if w.scatter is None:
                continue
            lo, hi = w.heads[0] - lay.head_start, w.heads[1] - lay.head_start
            k = lay.slices_per_page(w.heads)
            view = buf.view(L, 2, lay.num_pages * k, P, hi - lo, D)
            staged = staged_pages(staging[w.scatter], 0, len(pages), k)
            copy_pages(pool[:, :, :, :, lo:hi], pages, view, staged)
        self.stats["scattered_rooms"] += 1

    def free(self, staging: list[list[int]]) -> None:
        for pages in staging:
            self.cache.free_staging(pages)
