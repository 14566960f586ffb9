"""Page allocator for the KV pool.

Works in pages; callers speak in token slots. With page_size P, a request's
positions [0, seq_len) occupy ceil(seq_len / P) pages, and position `p` sits at
slot `page * P + p % P`. Extending a request first fills the free tail of its
last page, then takes whole new pages:

    prefix_len = 5, extend_len = 6, P = 4
    positions : 0 1 2 3 | 4 5 6 7 | 8 9 10 11
    owned     : [page a] | [b: 4 used, 5..7 free tail]
    new slots : b*4+1, b*4+2, b*4+3 (tail) | c*4+0, c*4+1, c*4+2 (new page c)

Frees may be batched with free_group_begin/free_group_end so that retiring a
whole batch costs one tensor op instead of one per request.

Between hold_begin and hold_end a freed page is *held*: neither free nor allocated, and
handed out by no allocation until reclaim(). Under overlap the scheduler frees pages while
it processes batch N-1's results, when batch N, already launched, may still write some of
them; a page handed out then could take a KV transfer's write (NIXL, not ordered with the
forward) under N's. The owner (scheduler/cache_manager.py) reclaims once N has completed.
"""

from __future__ import annotations

import numpy as np
import torch


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, device: torch.device | str) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        # Page 0 is reserved (see memory_pool.py), so it is neither free nor in use.
        self.capacity_pages = num_pages - 1
        self._allocated = torch.zeros(num_pages, dtype=torch.bool)
        self._free_pages = torch.arange(1, num_pages, dtype=torch.int64)
        self._held = torch.zeros(num_pages, dtype=torch.bool)  # freed, not yet reclaimed
        self._holding = False
        self._any_held = False  # reclaim runs every loop step: skip the mask scan when none are
        self._group: list[torch.Tensor] | None = None
        # Keep the free list in page order, so that an allocation takes the lowest free pages
        # and they are mostly consecutive: a KV transfer moves each run of consecutive pages
        # as one descriptor per layer and K/V instead of one per page. It costs one pass over
        # the allocation mask per free; the PD roles ask for it (RolePart.contiguous_pages).
        self.sorted_free = False

    def keep_free_list_sorted(self) -> None:
        """Hand out the lowest free pages first from now on (see `sorted_free`)."""
        self.sorted_free = True
        self._sort_free_list()

    def _sort_free_list(self) -> None:
        # +1: the mask is sliced from page 1, so nonzero's index i is page i + 1
        self._free_pages = torch.nonzero(~(self._allocated[1:] | self._held[1:])).flatten() + 1

    # ---- queries ---------------------------------------------------------------------
    def available_size(self) -> int:
        """Free capacity in tokens."""
        return int(self._free_pages.numel()) * self.page_size

    def held_pages(self) -> int:
        """Pages freed since the last reclaim() while holding: not free yet."""
        return int(self._held.sum())

    def pages_needed(self, prefix_len: int, extend_len: int) -> int:
        """New pages to extend a request holding `prefix_len` tokens by `extend_len`."""
        P = self.page_size
        return -(-(prefix_len + extend_len) // P) - (-(-prefix_len // P))

    # ---- allocation ------------------------------------------------------------------
    def alloc_pages(self, n: int) -> torch.Tensor | None:
        if n > self._free_pages.numel():
            return None
        pages, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        if bool(self._allocated[pages].any()):
            raise RuntimeError("page allocator corrupted: handed out a page twice")
        self._allocated[pages] = True
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens starting on a fresh page (a request with no prefix)."""
        return self.alloc_extend([0], [num_tokens], [0])

    def alloc_extend(
        self, prefix_lens: list[int], extend_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for each request's new tokens, concatenated in request order.

        `last_locs[i]` is the slot of request i's token at position prefix_len-1
        (ignored when prefix_len is page-aligned). Returns None, allocating
        nothing, if the pool cannot hold all of them.
        """
        P = self.page_size
        need = [self.pages_needed(p, e) for p, e in zip(prefix_lens, extend_lens)]
        pages = self.alloc_pages(sum(need))
        if pages is None:
            return None
        out: list[torch.Tensor] = []
        cursor = 0
        for prefix, extend, last, n_new in zip(prefix_lens, extend_lens, last_locs, need):
            tail = min((-prefix) % P, extend)  # free slots left in the last owned page
            if tail:
                out.append(torch.arange(last + 1, last + 1 + tail, dtype=torch.int64))
            if n_new:
                new = pages[cursor : cursor + n_new]
                cursor += n_new
                slots = (new[:, None] * P + torch.arange(P)[None, :]).flatten()
                out.append(slots[: extend - tail])
        if not out:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(out)

    def alloc_decode(self, seq_lens: np.ndarray, last_locs: np.ndarray) -> np.ndarray | None:
        """One slot per request for the token at position seq_len-1 (seq_len counts it), as int64
        numpy: this runs every decode step, and numpy on a few hundred ints costs the host a
        fraction of what torch ops do. A request whose new position starts a page
        ((seq_len-1) % P == 0) takes a fresh page; every other one writes the slot after its last."""
        P = self.page_size
        starts_page = (seq_lens - 1) % P == 0
        n_new = int(starts_page.sum())
        slots = last_locs.astype(np.int64) + 1
        if n_new:
            pages = self.alloc_pages(n_new)
            if pages is None:
                return None
            slots[starts_page] = pages.numpy() * P
        return slots

    # ---- freeing ---------------------------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding `slots`. Callers pass whole pages' worth of slots
        (a request's full span or a page-aligned suffix), never part of a shared page."""
        if slots.numel() == 0:
            return
        if self._group is not None:
            self._group.append(slots)
            return
        pages = torch.unique(slots.to("cpu", torch.int64) // self.page_size)
        if bool((pages == 0).any()) or not bool(self._allocated[pages].all()):
            raise RuntimeError("double free or free of a page that was never allocated")
        self._allocated[pages] = False
        if self._holding:
            self._held[pages] = True
            self._any_held = True
        else:
            self._release(pages)

    def _release(self, pages: torch.Tensor) -> None:
        if self.sorted_free:
            self._sort_free_list()
        else:
            self._free_pages = torch.cat([self._free_pages, pages])

    def free_group_begin(self) -> None:
        self._group = []

    def free_group_end(self) -> None:
        group, self._group = self._group, None
        if group:
            self.free(torch.cat(group))

    # ---- holding ---------------------------------------------------------------------
    def hold_begin(self) -> None:
        """Hold every page freed from now until hold_end() (see the module docstring)."""
        self._holding = True

    def hold_end(self) -> None:
        self._holding = False

    def reclaim(self) -> None:
        """Make held pages allocatable: no batch that could write them is still running."""
        if not self._any_held:
            return
        self._any_held = False
        pages = torch.nonzero(self._held).flatten()
        self._held[pages] = False
        self._release(pages)

    # ---- integrity ---------------------------------------------------------------------
    def check_integrity(self, in_use_pages: int | None = None) -> None:
        """free + held + in use == total, with no page in two of them.

        `in_use_pages`, when the owners (cache and running requests) can count
        theirs, must equal the allocator's count: a mismatch is a leak."""
        free = self._free_pages
        # Marking is linear; torch.unique sorted the whole free list (~20 ms at 250k pages,
        # which a request arriving during the idle check waited for).
        seen = torch.zeros_like(self._allocated)
        seen[free] = True
        assert int(seen.sum()) == free.numel(), "a page is on the free list twice"
        assert not bool(self._allocated[free].any()), "a free page is marked allocated"
        assert not bool(self._held[free].any()), "a free page is marked held"
        assert not bool((self._held & self._allocated).any()), "a held page is marked allocated"
        n_alloc, n_held = int(self._allocated.sum()), self.held_pages()
        assert n_alloc + n_held + free.numel() == self.capacity_pages, (
            f"pages lost: allocated {n_alloc} + held {n_held} + free {free.numel()} != {self.capacity_pages}"
        )
        if in_use_pages is not None:
            assert n_alloc == in_use_pages, f"owners hold {in_use_pages} pages, allocator has {n_alloc}"

    @property
    def used_pages(self) -> int:
        """Pages not free: allocated or held."""
        return self.capacity_pages - int(self._free_pages.numel())
