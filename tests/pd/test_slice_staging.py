"""The prefill side's staging of head-slice sends (prefill/staging.py): the staged layout holds
exactly the slice of the source pages as whole pages, ranges are held per chunk until
released, and a chunk that cannot be staged falls back to slices instead of failing.
Real NIXL sends through the staging buffer: tests/pd/test_kv_transfer_tp.py (`staged`)."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.pd.transfer.contract import TransferError
from tandem.pd.transfer.pages import descriptors
from tandem.prefill.staging import ALIGN, CUDA_CAP, Ranges, SliceStaging, staging_bytes

LAYERS, PAGE, HEADS, DIM = 2, 4, 4, 8


class Agent:
    """The transfer's side of staging: what was registered; `refuse` makes registration fail."""

    def __init__(self, refuse: bool = False) -> None:
        self.regions: list[tuple[int, int]] = []
        self.refuse = refuse

    def add_staging(self, addr: int, nbytes: int) -> None:
        if self.refuse:
            raise TransferError("NIXL refused the staging buffer")
        self.regions.append((addr, nbytes))


def pool(heads: tuple[int, int] = (0, HEADS), pages: int = 16) -> TokenToKVPool:
    p = TokenToKVPool(num_pages=pages, page_size=PAGE, num_layers=LAYERS, num_kv_heads=heads[1] - heads[0],
                      head_dim=DIM, dtype=torch.bfloat16, device="cpu", heads=heads, total_kv_heads=HEADS)
    p.kv_buffer.copy_(torch.randn_like(p.kv_buffer, dtype=torch.float32).to(torch.bfloat16))
    return p


def staged_tensor(lay) -> torch.Tensor:
    """A staged layout's bytes, as (layers, 2, pages, P, heads, dim)."""
    n = lay.total_bytes
    raw = (ctypes.c_uint8 * n).from_address(lay.base_ptr)
    return torch.frombuffer(raw, dtype=torch.bfloat16).view(LAYERS, 2, lay.num_pages, PAGE, lay.num_kv_heads, DIM)


@pytest.mark.parametrize("pages", [[3, 4, 5], [9, 2, 7, 8], [1]], ids=["one-run", "scattered", "one-page"])
@pytest.mark.parametrize("heads", [(0, 2), (2, 4), (1, 2)])
def test_the_staged_pages_are_the_slice_of_the_source_pages(pages: list[int], heads: tuple[int, int]) -> None:
    src, agent = pool(), Agent()
    staging = SliceStaging(src, agent, staging_bytes(src.layout(), 16))
    lay = staging.stage("7:1", pages, heads)
    assert lay is not None and lay.heads == heads and lay.num_pages == len(pages) + 1
    assert len(agent.regions) == 1  # registered once, on first use
    a, n = agent.regions[0]
    assert a <= lay.base_ptr and lay.base_ptr + lay.total_bytes <= a + n
    got = staged_tensor(lay)[:, :, 1:]
    want = src.kv_buffer.view(LAYERS, 2, 16, PAGE, HEADS, DIM)[:, :, pages, :, heads[0] : heads[1]]
    assert torch.equal(got, want)
    # To a decode rank holding exactly the slice: whole page runs, one per layer and K/V.
    dst = pool(heads).layout()
    s, d = descriptors(lay, dst, range(1, len(pages) + 1), [5 + i for i in range(len(pages))], heads)
    assert len(s) == LAYERS * 2
    staging.release("7:1")
    staging.check_integrity()


def test_ranges_are_held_per_chunk_until_released() -> None:
    src = pool()
    half = SliceStaging(src, Agent(), 0)._staged(2, (0, 2)).total_bytes  # 2 pages of 2 heads
    staging = SliceStaging(src, Agent(), 2 * half)  # one 2-page chunk at full width
    assert staging.stage("1:1", [1, 2], (0, 2)) is not None
    assert staging.stage("1:1", [1, 2], (2, 4)) is not None  # the chunk's second write
    assert staging.stage("2:1", [3, 4], (0, 2)) is None  # full: the caller waits
    assert staging.fits(2, (0, 2)) and not staging.fits(8, (0, 4))  # ... for room, or sends slices
    assert staging.stats["staged_sends"] == 2
    with pytest.raises(AssertionError, match="staging held while idle"):
        staging.check_integrity()
    staging.release("1:1")
    assert staging.stage("2:1", [3, 4], (0, 2)) is not None  # freed: fits again
    staging.release("2:1")
    staging.release("never-held")  # a chunk with no gather writes: nothing to free
    staging.check_integrity()


def test_a_buffer_that_cannot_be_registered_leaves_every_send_to_slices() -> None:
    agent = Agent(refuse=True)
    staging = SliceStaging(pool(), agent, 1 << 20)
    assert not staging.fits(1, (0, 2)) and staging.stage("1:1", [1], (0, 2)) is None
    assert staging.unavailable and staging.buffer is None
    agent.refuse = False
    assert staging.stage("1:2", [1], (0, 2)) is None  # not retried every chunk
    assert not agent.regions
    assert SliceStaging(pool(), agent, 0).stage("1:1", [1], (0, 2)) is None  # capacity 0: staging off
    assert not agent.regions


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_one_chunk_to_every_decode_rank_fits_at_once(chunk: int) -> None:
    """A chunk of `chunk` tokens sends at most chunk + P - 1 from a page boundary: both halves
    (prefill TP 1 -> decode TP 2) stage together; on a GPU the buffer is capped."""
    src = pool(pages=32)
    lay = src.layout()
    staging = SliceStaging(src, Agent(), staging_bytes(lay, chunk))
    pages = -(-(chunk + PAGE - 1) // PAGE)
    assert staging.stage("k", list(range(1, pages + 1)), (0, 2)) is not None
    assert staging.stage("k", list(range(1, pages + 1)), (2, 4)) is not None
    vram = dataclasses.replace(lay, mem_type="VRAM")
    assert staging_bytes(vram, 1 << 20) == CUDA_CAP < staging_bytes(lay, 1 << 20)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=40))
def test_ranges_never_overlap_and_stay_inside(ops: list[tuple[bool, int]]) -> None:
    r, live = Ranges(8192), []
    for take, n in ops:
        if take or not live:
            start = r.take(n)
            if start is not None:
                assert start % ALIGN == 0 and start + n <= 8192
                live.append((start, start + n))
        else:
            r.free(live.pop(n % len(live))[0])
        spans = sorted(live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert sorted(r.used) == spans
    for start, _ in live:
        r.free(start)
    assert r.take(8192) == 0  # everything freed: the whole buffer is one range again
