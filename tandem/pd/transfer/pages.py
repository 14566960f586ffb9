"""Which bytes a page transfer moves, as (address, length) runs for a transfer engine.

A request's KV is whole pages in every layer, K and V (tandem.protocol.kv_layout):
page p of (layer, kv) is `page_bytes` at layout.page_addr(layer, kv, p). Source page
src[i] goes to destination page dst[i]. Consecutive pages on both sides
(src[i+1] = src[i] + 1 and dst[i+1] = dst[i] + 1) are one run, so a freshly allocated
request usually moves as one descriptor per layer and K/V, not one per page.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.protocol.kv_layout import KVLayout

Run = tuple[int, int, int]  # (first source page, first destination page, pages)


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    runs: list[Run] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def descriptors(src_layout: KVLayout, dst_layout: KVLayout, src: Sequence[int],
                dst: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(source runs, destination runs) as (address, bytes), in matching order."""
    problems = src_layout.mismatch(dst_layout)
    if problems:
        raise ValueError("KV layouts differ: " + "; ".join(problems))
    for name, pages, lay in (("source", src, src_layout), ("destination", dst, dst_layout)):
        bad = [p for p in pages if not 0 < p < lay.num_pages]  # page 0 is the pad page: never moved
        if bad:
            raise ValueError(f"{name} page {bad[0]} outside 1..{lay.num_pages - 1}")
    runs = page_runs(src, dst)
    out_src: list[tuple[int, int]] = []
    out_dst: list[tuple[int, int]] = []
    for layer in range(src_layout.num_layers):
        for kv in (0, 1):
            for s, d, n in runs:
                out_src.append((src_layout.page_addr(layer, kv, s), n * src_layout.page_bytes))
                out_dst.append((dst_layout.page_addr(layer, kv, d), n * dst_layout.page_bytes))
    return out_src, out_dst
