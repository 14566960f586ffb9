"""Unit tests of the KV pools and the page allocator's index arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tandem.engine.kvcache.allocator import PageAllocator
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool


def test_alloc_extend_fills_tail_then_new_pages() -> None:
    a = PageAllocator(num_pages=8, page_size=4, device="cpu")
    first = a.alloc(5)  # pages p0 (4 slots) + 1 slot of p1
    assert first.tolist()[:4] == list(range(first[0], first[0] + 4))
    more = a.alloc_extend([5], [6], [int(first[-1])])
    # 3 slots complete the second page, then 3 slots start a fresh page
    assert more[:3].tolist() == [int(first[-1]) + 1 + i for i in range(3)]
    assert more[3] % 4 == 0 and more[3:].tolist() == [int(more[3]) + i for i in range(3)]
    assert a.used_pages == 3
    a.check_integrity(in_use_pages=3)


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_pages_needed_matches_allocation(page_size: int) -> None:
    a = PageAllocator(num_pages=64, page_size=page_size, device="cpu")
    for prefix in range(0, 20):
        for extend in range(0, 20):
            want = -(-(prefix + extend) // page_size) - (-(-prefix // page_size))
            assert a.pages_needed(prefix, extend) == want


def test_alloc_decode_crosses_page_boundary_only_when_needed() -> None:
    a = PageAllocator(num_pages=8, page_size=4, device="cpu")
    s = a.alloc(4)  # exactly one full page
    used = a.used_pages
    d = a.alloc_decode(np.array([5]), s[-1:].numpy())  # position 4 -> new page
    assert a.used_pages == used + 1 and int(d[0]) % 4 == 0
    d2 = a.alloc_decode(np.array([6]), d[:1])  # position 5 -> same page
    assert a.used_pages == used + 1 and int(d2[0]) == int(d[0]) + 1


def test_exhaustion_allocates_nothing() -> None:
    a = PageAllocator(num_pages=4, page_size=2, device="cpu")  # 3 usable pages = 6 tokens
    assert a.alloc(7) is None
    assert a.available_size() == 6
    assert a.alloc(6) is not None and a.available_size() == 0


def test_free_and_double_free() -> None:
    a = PageAllocator(num_pages=8, page_size=4, device="cpu")
    s = a.alloc(10)
    a.free(s)
    a.check_integrity(in_use_pages=0)
    with pytest.raises(RuntimeError):
        a.free(s)


def test_integrity_finds_a_page_on_the_free_list_twice() -> None:
    a = PageAllocator(num_pages=8, page_size=4, device="cpu")
    a.check_integrity(in_use_pages=0)
    a._free_pages = torch.cat([a._free_pages[:-1], a._free_pages[:1]])  # page 1 twice, the count unchanged
    with pytest.raises(AssertionError, match="twice"):
        a.check_integrity()


def test_free_group_batches_frees() -> None:
    a = PageAllocator(num_pages=16, page_size=2, device="cpu")
    parts = [a.alloc(3), a.alloc(4), a.alloc(1)]
    before = a.available_size()
    a.free_group_begin()
    for p in parts:
        a.free(p)
    assert a.available_size() == before  # nothing freed until the group ends
    a.free_group_end()
    a.check_integrity(in_use_pages=0)


def test_page_zero_is_never_handed_out() -> None:
    a = PageAllocator(num_pages=5, page_size=4, device="cpu")
    s = a.alloc(16)
    assert int(s.min()) >= 4
    with pytest.raises(RuntimeError):
        a.free(torch.tensor([0]))


def test_req_to_token_pool_slots() -> None:
    p = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    rows = p.alloc(3)
    assert p.alloc(1) is None
    p.write(rows[0], 2, torch.tensor([7, 8]))
    assert p.req_to_token[rows[0], 2:4].tolist() == [7, 8]
    p.free(rows[0])
    with pytest.raises(ValueError):
        p.free(rows[0])
    p.check_integrity(in_use=2)


def test_kv_pool_is_one_contiguous_buffer() -> None:
    pool = TokenToKVPool(num_pages=9, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device="cpu")
    assert pool.kv_buffer.is_contiguous()
    assert pool.k_buffer(1).data_ptr() == pool.kv_buffer[1, 0].data_ptr()
    assert pool.page_bytes_per_layer() == 4 * 2 * 8 * 4
    assert torch.all(pool.kv_buffer[:, :, :4] == 0)  # the pad page is finite
    loc = pool.allocator.alloc(3).to(torch.int64)
    k = torch.randn(3, 2, 8)
    pool.set_kv(2, loc, k, -k)
    assert torch.equal(pool.k_buffer(2)[loc], k) and torch.equal(pool.v_buffer(2)[loc], -k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_layout_addresses_every_page(dtype: torch.dtype) -> None:
    """The torch-free layout a transfer agent is handed names the same bytes torch does."""
    pool = TokenToKVPool(num_pages=5, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype,
                         device="cpu")
    lay = pool.layout()
    assert lay.total_bytes == pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    assert lay.page_bytes == pool.page_bytes_per_layer()
    for layer in range(3):
        for kv in (0, 1):
            for page in range(5):
                assert lay.page_addr(layer, kv, page) == pool.kv_buffer[layer, kv, page * 4].data_ptr()
    with pytest.raises(IndexError):
        lay.page_addr(3, 0, 0)
    other = TokenToKVPool(num_pages=9, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype,
                          device="cpu").layout()
    assert lay.mismatch(other) == []  # page counts may differ between workers
    assert lay.mismatch(dataclasses.replace(other, page_size=16, dtype="float16")) == [
        f"dtype: {lay.dtype} != float16", "page_size: 4 != 16"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_vectorised_decode_matches_extend_by_one(page_size: int) -> None:
    a, b = (PageAllocator(num_pages=64, page_size=page_size, device="cpu") for _ in range(2))
    seqs = [3, 4, 5, 8, 9]
    owned = [a.alloc(s) for s in seqs]
    [b.alloc(s) for s in seqs]
    last = torch.tensor([int(o[-1]) for o in owned])
    got = a.alloc_decode(np.array(seqs) + 1, last.numpy())
    want = b.alloc_extend(seqs, [1] * len(seqs), last.tolist())
    assert got.tolist() == want.tolist()


def test_freed_request_rows_are_held_until_reclaimed() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows[0])
    assert pool.alloc(1) is None  # held: a launched batch may still read the row
    with pytest.raises(ValueError):
        pool.free(rows[0])
    pool.check_integrity(in_use=1)
    pool.reclaim()
    assert pool.alloc(1) == [rows[0]]


@pytest.mark.parametrize("sorted_free", [False, True])
def test_pages_freed_while_holding_wait_for_reclaim(sorted_free: bool) -> None:
    a = PageAllocator(num_pages=5, page_size=2, device="cpu")
    if sorted_free:
        a.keep_free_list_sorted()
    pages = a.alloc_pages(4)
    a.hold_begin()
    a.free(pages[:2] * 2)
    a.hold_end()
    a.free(pages[3:] * 2)  # not holding: free at once
    assert a.held_pages() == 2 and a.available_size() == 2
    assert a.alloc_pages(2) is None  # held: a launched batch may still write them
    with pytest.raises(RuntimeError):
        a.free(pages[:1] * 2)  # a held page is already free
    a.check_integrity(in_use_pages=1)  # held is neither free nor in use
    a.reclaim()
    assert a.held_pages() == 0
    assert sorted(a.alloc_pages(3).tolist()) == sorted(pages[[0, 1, 3]].tolist())
    a.check_integrity(in_use_pages=4)


def test_sorted_free_list_hands_out_consecutive_pages() -> None:
    """The PD roles keep free pages in page order: after churn, a new allocation is one run."""
    for sorted_free, runs in ((False, 3), (True, 1)):
        a = PageAllocator(num_pages=17, page_size=4, device="cpu")
        a.sorted_free = sorted_free
        pages = a.alloc_pages(16)
        for p in (pages[8:10], pages[4:6], pages[6:8], pages[10:12]):  # pages 5..12, out of order
            a.free(p * 4)
        got = a.alloc_pages(8).tolist()
        assert sum(1 for i, p in enumerate(got) if i == 0 or p != got[i - 1] + 1) == runs, got
        a.check_integrity()


def test_kv_buffer_asks_for_huge_pages() -> None:
    import sys

    pool = TokenToKVPool(num_pages=1025, page_size=16, num_layers=2, num_kv_heads=4, head_dim=64,
                         dtype=torch.bfloat16, device="cpu")  # 16 MiB: several aligned 2 MiB pages
    if sys.platform == "linux":
        from tandem.engine.kvcache.memory_pool import advise_huge_pages

        assert advise_huge_pages(pool.kv_buffer)  # madvise accepts the aligned interior
    assert torch.count_nonzero(pool.kv_buffer[:, :, :16]) == 0  # the pad page is still zeroed
