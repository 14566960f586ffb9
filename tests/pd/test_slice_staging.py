"""The prefill side's staging of head-slice sends (prefill/staging.py): staging pages come from
the KV pool (evicting cached prefixes if need be) and go back when released; seen at the
slice's width they hold exactly the slice of the source pages, as whole pages a decode rank
holding just the slice takes in one descriptor per layer and K/V. The view's arithmetic
(KVLayout.sliced, pages.staged_pages) is checked against bytes. Real NIXL sends through
staging: tests/pd/test_kv_transfer_tp.py (`staged`); the waiting: test_rank_sends.py."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kv_caches import cache_over

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.pd.transfer.pages import descriptors, page_runs, staged_pages
from tandem.prefill.staging import SliceStaging

LAYERS, PAGE, HEADS, DIM = 2, 4, 4, 8


def cache(heads: tuple[int, int] = (0, HEADS), pages: int = 16) -> CacheManager:
    pool = TokenToKVPool(num_pages=pages, page_size=PAGE, num_layers=LAYERS, num_kv_heads=heads[1] - heads[0],
                         head_dim=DIM, dtype=torch.bfloat16, device="cpu", heads=heads, total_kv_heads=HEADS)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer, dtype=torch.float32).to(torch.bfloat16))
    return cache_over(pool)


def page_bytes_at(lay, pages: list[int]) -> torch.Tensor:
    """The bytes of `pages` of a layout, read at their addresses: (layers, 2, pages, P, heads, dim)."""
    out = []
    for layer in range(lay.num_layers):
        for kv in (0, 1):
            for p in pages:
                raw = (ctypes.c_uint8 * lay.page_bytes).from_address(lay.page_addr(layer, kv, p))
                out.append(torch.frombuffer(bytearray(raw), dtype=torch.bfloat16))
    return torch.stack(out).view(lay.num_layers, 2, len(pages), PAGE, lay.num_kv_heads, DIM)


@pytest.mark.parametrize("pages", [[3, 4, 5], [9, 2, 7, 8], [1], [10, 1, 9, 3, 8, 5, 7, 2, 6]],
                         ids=["one-run", "scattered", "one-page", "more-runs-than-copies"])
@pytest.mark.parametrize("heads", [(0, 2), (2, 4), (1, 2)])
def test_the_staged_pages_are_the_slice_of_the_source_pages(pages: list[int], heads: tuple[int, int]) -> None:
    c = cache()
    c.allocator.alloc_pages(10)  # the source pages belong to a request: staging takes others
    staging = SliceStaging(c)
    free = c.allocator.available_size()
    view, staged = staging.stage("7:1>0", pages, heads)
    k = HEADS // (heads[1] - heads[0])
    assert view.heads == heads and view.base_ptr == c.kv_pool.layout().base_ptr
    assert view.total_bytes == c.kv_pool.layout().total_bytes  # the pool itself, seen at the slice's width
    assert free - c.allocator.available_size() == -(-len(pages) // k) * PAGE  # ceil(n / k) pool pages
    want = c.kv_pool.kv_buffer.view(LAYERS, 2, 16, PAGE, HEADS, DIM)[:, :, pages, :, heads[0] : heads[1]]
    assert torch.equal(page_bytes_at(view, staged), want)
    # To a decode rank holding exactly the slice: whole page runs.
    dst = cache(heads).kv_pool.layout()
    s, _ = descriptors(view, dst, staged, [5 + i for i in range(len(pages))], heads)
    assert len(s) <= LAYERS * 2 * len(page_runs(staged, range(len(pages))))
    staging.release("7:1>0")
    staging.check_integrity()
    assert c.allocator.available_size() == free


def test_staging_evicts_cached_prefixes_and_waits_when_the_pool_is_full() -> None:
    c = cache(pages=5)  # 4 usable pages
    held = c.allocator.alloc_pages(3)
    staging = SliceStaging(c)
    assert staging.stage("a>0", [1, 2], (0, 2)) is not None  # one pool page: 2 staged pages of 2 heads
    assert staging.stage("a>1", [1, 2], (2, 4)) is None  # the pool is full now
    assert staging.fits(8, (0, 2)) and not staging.fits(9, (0, 2))  # 4 pool pages at most, ever
    with pytest.raises(AssertionError, match="staging pages held while idle"):
        staging.check_integrity()
    staging.release("a>0")
    staging.release("never-held")
    assert staging.stage("a>1", [1, 2], (2, 4)) is not None
    staging.release("a>1")
    staging.check_integrity()
    c.allocator.free((held[:, None] * PAGE + torch.arange(PAGE)).flatten())
    c.allocator.check_integrity(in_use_pages=0)


@given(st.integers(1, 4).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, 12), st.integers(1, 12))))
def test_staged_pages_tile_the_pool_pages_in_order(case: tuple[int, int, int]) -> None:
    k, first, count = case
    pool_pages = [(37 * i) % 101 + 1 for i in range(-(-(first + count) // k))]  # distinct, not in order
    got = staged_pages(pool_pages, first, count, k)
    assert len(set(got)) == count
    for i, v in zip(range(first, first + count), got):
        assert v // k == pool_pages[i // k] and v % k == i % k


def test_a_slice_view_is_the_same_bytes_at_another_width() -> None:
    lay = cache().kv_pool.layout()
    view = lay.sliced((2, 4))
    assert (view.num_pages, view.page_bytes * 2) == (2 * lay.num_pages, lay.page_bytes)
    assert view.total_bytes == lay.total_bytes
    assert view.page_addr(1, 1, 2 * 5 + 1) == lay.page_addr(1, 1, 5) + lay.page_bytes // 2
    for bad in ((0, 3), (2, 2), (3, 5)):
        with pytest.raises(ValueError, match="do not divide"):
            lay.sliced(bad)
