"""Which bytes a page transfer moves, as (address, length) rows for a transfer engine.

A request's KV is whole pages in every layer, K and V (tandem.protocol.kv_layout):
page p of (layer, kv) is `page_bytes` at layout.page_addr(layer, kv, p). Source page
src[i] goes to destination page dst[i].

Whole slots (both sides hold exactly the heads moved: same TP rank, or no TP): consecutive
pages on both sides (src[i+1] = src[i] + 1 and dst[i+1] = dst[i] + 1) are one run, so a
freshly allocated request usually moves as one descriptor per layer and K/V, not one per page.

Head slices (the TP sizes differ: tandem/pd/transfer/head_map.py): heads [h0, h1) of a
token are contiguous on each side, but the next token's lie a slot further on, and at least
one side's slot holds more than the slice, so no two tokens coalesce: one descriptor per
(layer, K/V, page, token), in that order on both sides:

    address = page_addr(layer, kv, page) + tok * slot_bytes + (h0 - head_start) * head_bytes
    length  = (h1 - h0) * head_bytes

Those are built with numpy: a 4096-token chunk of a 32-layer model is 262,144 rows, ~50 ms
as Python tuples and a few ms as arrays, on the scheduler's thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.protocol.kv_layout import HeadRange, KVLayout, Run, page_runs

__all__ = ["Descs", "Run", "descriptors", "page_runs", "staged_pages"]

Descs = np.ndarray  # (n, 2) uint64: address, bytes


def descriptors(src_layout: KVLayout, dst_layout: KVLayout, src: Sequence[int], dst: Sequence[int],
                heads: HeadRange | None = None) -> tuple[Descs, Descs]:
    """(source rows, destination rows), in matching order, moving the model's KV `heads`
    (None: every head the destination holds) of src pages into dst pages."""
    problems = src_layout.mismatch(dst_layout)
    if problems:
        raise ValueError("KV layouts differ: " + "; ".join(problems))
    for name, pages, lay in (("source", src, src_layout), ("destination", dst, dst_layout)):
        bad = [p for p in pages if not 0 < p < lay.num_pages]  # page 0 is the pad page: never moved
        if bad:
            raise ValueError(f"{name} page {bad[0]} outside 1..{lay.num_pages - 1}")
    h0, h1 = heads if heads is not None else dst_layout.heads
    for name, lay in (("source", src_layout), ("destination", dst_layout)):
        if not lay.heads[0] <= h0 < h1 <= lay.heads[1]:
            raise ValueError(f"KV heads [{h0}, {h1}) are not all held by the {name}'s [{lay.heads[0]}, {lay.heads[1]})")
    runs = page_runs(src, dst)
    if (h0, h1) == src_layout.heads == dst_layout.heads:
        return _whole_pages(src_layout, dst_layout, runs)
    return _head_slices(src_layout, src, h0, h1), _head_slices(dst_layout, dst, h0, h1)


def staged_pages(pool_pages: Sequence[int], first: int, count: int, per_page: int) -> list[int]:
    """Pages `first .. first + count` of a staged slice, as pages of the buffer seen at the
    slice's width (KVLayout.sliced): staged page i lies in pool page pool_pages[i // per_page],
    its (i % per_page)-th part, so any pool pages serve, consecutive or not."""
    return [pool_pages[i // per_page] * per_page + i % per_page for i in range(first, first + count)]


def _whole_pages(src_layout: KVLayout, dst_layout: KVLayout, runs: list[Run]) -> tuple[Descs, Descs]:
    out_src: list[tuple[int, int]] = []
    out_dst: list[tuple[int, int]] = []
    for layer in range(src_layout.num_layers):
        for kv in (0, 1):
            for s, d, n in runs:
                out_src.append((src_layout.page_addr(layer, kv, s), n * src_layout.page_bytes))
                out_dst.append((dst_layout.page_addr(layer, kv, d), n * dst_layout.page_bytes))
    return _rows(out_src), _rows(out_dst)


def _head_slices(lay: KVLayout, pages: Sequence[int], h0: int, h1: int) -> Descs:
    u = np.uint64
    per_lkv = (np.arange(lay.num_layers, dtype=u)[:, None] * u(lay.layer_stride)
               + np.arange(2, dtype=u)[None, :] * u(lay.kv_stride)).reshape(-1)  # (layers * 2,)
    per_page = np.asarray(pages, dtype=u) * u(lay.page_bytes)  # (pages,)
    per_tok = np.arange(lay.page_size, dtype=u) * u(lay.slot_bytes)  # (page_size,)
    start = u(lay.base_ptr + (h0 - lay.head_start) * lay.head_bytes)
    addr = (per_lkv[:, None, None] + per_page[None, :, None] + per_tok[None, None, :] + start).reshape(-1)
    return np.stack([addr, np.full_like(addr, (h1 - h0) * lay.head_bytes)], axis=1)


def _rows(rows: list[tuple[int, int]]) -> Descs:
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)
