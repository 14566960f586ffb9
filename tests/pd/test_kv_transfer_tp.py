"""The KV transfer contract across tensor-parallel sizes (tandem/pd/transfer/contract.py):
each TP rank's pool holds a range of the model's KV heads; prefill ranks write decode ranks
the heads tandem/pd/transfer/head_map.py plans, and every decode rank ends up with exactly
its heads of the reference KV and one first token. The descriptor arithmetic (pages.py) is
checked alone against a torch reference by copying bytes along the descriptors; then real
NIXL transfers (one process, one agent per rank, CPU memory). Last, the handshake's bounds
on a peer's head range."""

from __future__ import annotations

import ctypes
import dataclasses
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kv_caches import cache_over
from waits import wait_until

from tandem.decode.staging import ScatterStaging
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.pd import protocol as pd
from tandem.pd.parts import Link
from tandem.pd.transfer.contract import Events
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.pd.transfer.head_map import plan_writes, shard_heads, staging_of
from tandem.pd.transfer.pages import descriptors, staged_pages
from tandem.prefill.staging import SliceStaging
from tandem.protocol.kv_layout import KVLayout

LAYERS, PAGE, DIM, SRC_PAGES, DST_PAGES = 3, 4, 8, 16, 24


class Rank:
    """One TP rank's pool: heads [h0, h1) of a model with `total` KV heads."""

    def __init__(self, total: int, tp: int, rank: int, num_pages: int, ref: torch.Tensor | None = None,
                 device: str = "cpu") -> None:
        self.h0, self.h1 = shard_heads(total, tp, rank)
        self.pool = TokenToKVPool(num_pages=num_pages, page_size=PAGE, num_layers=LAYERS,
                                  num_kv_heads=self.h1 - self.h0, head_dim=DIM, dtype=torch.bfloat16, device=device,
                                  heads=(self.h0, self.h1), total_kv_heads=total)
        self.pool.kv_buffer.zero_()
        if ref is not None:  # (layers, 2, slots, heads, dim): this rank's share of the model's KV
            self.pool.kv_buffer[:, :, : ref.shape[2]].copy_(ref[:, :, :, self.h0 : self.h1])
        self.layout = self.pool.layout()


def reference(total: int) -> torch.Tensor:
    return (torch.rand(LAYERS, 2, SRC_PAGES * PAGE, total, DIM) + 1).to(torch.bfloat16)  # no zeros


def slots_of(buf: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Pages `ids` of a (layers, 2, slots, heads, dim) buffer, as (layers, 2, pages * PAGE, heads, dim)."""
    return torch.cat([buf[:, :, i * PAGE : (i + 1) * PAGE] for i in ids], dim=2)


def others(buf: torch.Tensor, ids: list[int]) -> torch.Tensor:
    keep = [i for i in range(buf.shape[2] // PAGE) if i not in ids]
    return slots_of(buf, keep)


def copy_along(src, dst) -> None:
    assert src.shape == dst.shape and (src[:, 1] == dst[:, 1]).all()
    for (s, n), (d, _) in zip(src.tolist(), dst.tolist()):
        ctypes.memmove(d, s, n)


SRC_IDS, DST_IDS = [3, 4, 7, 8, 9], [10, 11, 2, 3, 4]


@pytest.mark.parametrize("total, tp_src, tp_dst, heads", [
    (4, 1, 2, (2, 4)),  # the whole source slot to half of it
    (4, 2, 1, (0, 2)),  # half of the source's heads into the whole destination slot
    (4, 1, 1, (1, 3)),  # a slice on both sides
    (2, 1, 4, (1, 2)),  # into a replicated head
])
def test_head_slice_descriptors_copy_exactly_those_heads(total: int, tp_src: int, tp_dst: int, heads) -> None:
    ref = reference(total)
    src = Rank(total, tp_src, tp_src - 1 if heads[0] else 0, SRC_PAGES, ref)
    dst = Rank(total, tp_dst, tp_dst - 1, DST_PAGES)
    s, d = descriptors(src.layout, dst.layout, SRC_IDS, DST_IDS, heads)
    assert len(s) == LAYERS * 2 * len(SRC_IDS) * PAGE  # one per token: nothing coalesces
    copy_along(s, d)
    h0, h1 = heads
    got = slots_of(dst.pool.kv_buffer, DST_IDS)
    assert torch.equal(got[:, :, :, h0 - dst.h0 : h1 - dst.h0], slots_of(ref, SRC_IDS)[:, :, :, h0:h1])
    assert torch.count_nonzero(got) == got[:, :, :, h0 - dst.h0 : h1 - dst.h0].numel()  # other heads untouched
    assert torch.count_nonzero(others(dst.pool.kv_buffer, DST_IDS)) == 0


def test_whole_slots_stay_whole_page_runs() -> None:
    ref = reference(4)
    src, dst = Rank(4, 2, 1, SRC_PAGES, ref), Rank(4, 2, 1, DST_PAGES)
    s, d = descriptors(src.layout, dst.layout, SRC_IDS, DST_IDS, (2, 4))
    assert len(s) == LAYERS * 2 * 2  # runs [3, 4] -> [10, 11] and [7, 8, 9] -> [2, 3, 4]
    assert (s == descriptors(src.layout, dst.layout, SRC_IDS, DST_IDS)[0]).all()  # None: the peer's heads
    copy_along(s, d)
    assert torch.equal(slots_of(dst.pool.kv_buffer, DST_IDS), slots_of(ref, SRC_IDS)[:, :, :, 2:4])


def test_heads_a_side_does_not_hold_are_refused() -> None:
    half, full = Rank(4, 2, 0, SRC_PAGES).layout, Rank(4, 1, 0, DST_PAGES).layout
    with pytest.raises(ValueError, match=r"\[1, 3\) are not all held by the source's \[0, 2\)"):
        descriptors(half, full, [1], [1], (1, 3))
    with pytest.raises(ValueError, match="not all held by the source"):
        descriptors(half, full, [1], [1])  # None: all the destination's four
    with pytest.raises(ValueError, match="not all held"):
        descriptors(full, full, [1], [1], (2, 2))
    with pytest.raises(ValueError, match="total_heads"):
        descriptors(half, Rank(8, 2, 0, DST_PAGES).layout, [1], [1], (0, 2))


# ---- real NIXL transfers, one agent per rank -----------------------------------------------------
nixl_agent = pytest.importorskip("tandem.pd.transfer.nixl_agent")


@pytest.fixture(scope="module", autouse=True)
def _nixl() -> None:
    try:
        nixl_agent.nixl_api()
    except ImportError:
        pytest.skip("NIXL is not installed")


@pytest.mark.parametrize("staged", [False, True], ids=["slices", "staged"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("total, tp_p, tp_d", [
    (4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4), (2, 2, 4), (4, 2, 2),
])
def test_every_decode_rank_gets_its_heads_and_one_first_token(total: int, tp_p: int, tp_d: int, device: str,
                                                              staged: bool) -> None:
    """On host memory, or VRAM to VRAM on one GPU (every rank's pool on it). `staged`: as the
    PD roles send them, the plan's gather writes go through the prefill rank's staging pages
    (prefill/staging.py), its scatter writes into the decode rank's (decode/staging.py)."""
    ref = reference(total)
    pre = [Rank(total, tp_p, r, 2 * SRC_PAGES, ref, device) for r in range(tp_p)]  # the upper half: staging
    dec = [Rank(total, tp_d, r, 2 * DST_PAGES, device=device) for r in range(tp_d)]
    pre_slots = [FirstTokenSlots(4, device=device) for _ in pre]
    dec_slots = [FirstTokenSlots(8, device=device) for _ in dec]
    for p, s in enumerate(pre_slots):  # each prefill rank's own token: the decode slot says who wrote it
        s.write(1, 100 + p, -0.5, [])
    tag = f"{total}{tp_p}{tp_d}{device}{int(staged)}"
    pa = [nixl_agent.NixlTransfer(f"tp{tag}-p{r}") for r in range(tp_p)]
    da = [nixl_agent.NixlTransfer(f"tp{tag}-d{r}") for r in range(tp_d)]
    stagers = [SliceStaging(cache_over(r.pool)) for r in pre]
    scatters = [ScatterStaging(cache_over(r.pool)) for r in dec]
    for s, n in [(s, SRC_PAGES) for s in stagers] + [(s, DST_PAGES) for s in scatters]:
        s.cache.allocator.alloc_pages(n - 1)  # the reference KV's pages and the room's: staging takes others
    try:
        pmeta = [a.register(r.layout, s.region()) for a, r, s in zip(pa, pre, pre_slots)]
        dmeta = [a.register(r.layout, s.region()) for a, r, s in zip(da, dec, dec_slots)]
        writes = plan_writes([r.layout for r in pre], [r.layout for r in dec])
        plan = staging_of(writes, [r.layout for r in dec])
        reserved = [s.reserve(plan, len(DST_IDS)) if staged else [] for s in scatters]  # KVDest.staging
        for w in writes:
            peer = pa[w.prefill].add_peer(dmeta[w.decode], dec[w.decode].layout, dec_slots[w.decode].region())
            da[w.decode].add_peer(pmeta[w.prefill], pre[w.prefill].layout, pre_slots[w.prefill].region())
            source, src = stagers[w.prefill].stage(f"r1>{w.decode}", SRC_IDS, w.heads) if staged and w.gather \
                else (None, SRC_IDS)
            dest, dst = None, DST_IDS
            if staged and w.scatter is not None:
                dest = dec[w.decode].layout.sliced(w.heads)
                dst = staged_pages(reserved[w.decode][w.scatter], 0, len(DST_IDS), plan.per_page)
            pa[w.prefill].send(peer, "r1", src, dst, f"r1/{w.prefill}".encode(),
                               slot=(1, 5) if w.slot else None, heads=w.heads, source=source, dest=dest)
        events = {id(a): Events() for a in (*pa, *da)}

        def all_in() -> bool:
            for a in (*pa, *da):
                ev = a.poll()
                events[id(a)].sent += ev.sent
                events[id(a)].received += ev.received
            sent = sum(len(events[id(a)].sent) for a in pa)
            return sent == len(writes) and sum(len(events[id(a)].received) for a in da) == len(writes)

        wait_until(all_in, 20, "every send reported and every notification received", interval=0.001)
        assert all(done.ok for a in pa for done in events[id(a)].sent)
        for d, r in enumerate(dec):
            if reserved[d]:  # the room arrived: decode moves what it staged into the room's pages
                link = Link(tuple(w for w in writes if w.decode == d))
                scatters[d].scatter(link, reserved[d], DST_IDS)
                scatters[d].free(reserved[d])
            scatters[d].cache.allocator.check_integrity(in_use_pages=DST_PAGES - 1)
            writers = [w.prefill for w in writes if w.decode == d]
            assert sorted(events[id(da[d])].received) == sorted((f"tp{tag}-p{p}", f"r1/{p}".encode()) for p in writers)
            kv = r.pool.kv_buffer.cpu()
            assert torch.equal(slots_of(kv, DST_IDS), slots_of(ref, SRC_IDS)[:, :, :, r.h0 : r.h1])
            assert torch.count_nonzero(others(kv[:, :, : DST_PAGES * PAGE], DST_IDS)) == 0
            assert dec_slots[d].read(5)[0] == 100 + min(writers)  # one writer: the lowest prefill rank
        moved = LAYERS * 2 * len(SRC_IDS) * PAGE * DIM * 2 * sum(w.heads[1] - w.heads[0] for w in writes)
        assert sum(a.bytes_sent for a in pa) == moved
        assert sum(s.stats["staged_sends"] for s in stagers) == (sum(w.gather for w in writes) if staged else 0)
        assert sum(map(bool, reserved)) == (sum(w.scatter == 0 for w in writes) if staged else 0)
        for w in writes:
            stagers[w.prefill].release(f"r1>{w.decode}")
        for s in stagers:
            s.check_integrity()
    finally:
        for a in (*pa, *da):
            a.close()


def test_a_peer_of_another_tp_size_pairs_but_not_one_of_another_model() -> None:
    mine, theirs, alien = Rank(4, 2, 0, SRC_PAGES), Rank(4, 1, 0, DST_PAGES), Rank(8, 2, 0, DST_PAGES)
    a, b = nixl_agent.NixlTransfer("tpx-a"), nixl_agent.NixlTransfer("tpx-b")
    try:
        a.register(mine.layout)
        peer = a.add_peer(b.register(theirs.layout), theirs.layout)
        with pytest.raises(ValueError, match="total_heads: 4 != 8"):
            a.add_peer(b"unused", alien.layout)
        with pytest.raises(ValueError, match="not all held by the source"):
            a.send(peer, "r", [1], [1], b"r")  # the default: all four of the peer's heads
        with pytest.raises(ValueError, match="a send of nothing"):
            a.send(peer, "r", [], [], b"r", heads=(0, 2))
        # A send reads and writes slice views of the two registered buffers, nothing else.
        for bad in (dataclasses.replace(mine.layout.sliced((0, 1)), base_ptr=mine.layout.base_ptr + 4096),
                    dataclasses.replace(mine.layout.sliced((0, 1)), num_pages=mine.layout.num_pages),
                    dataclasses.replace(mine.layout.sliced((0, 1)), mem_type="VRAM")):
            with pytest.raises(ValueError, match="not a view of that side's registered KV buffer"):
                a.send(peer, "r", [1], [1], b"r", heads=(0, 1), source=bad)
        with pytest.raises(ValueError, match="destination is not a view"):
            a.send(peer, "r", [1], [1], b"r", heads=(0, 1), dest=mine.layout.sliced((0, 1)))
        assert not a.pending
    finally:
        a.close()
        b.close()


# ---- the handshake: a peer's head range is hostile input -----------------------------------------
def _hello(**layout: int) -> bytes:
    half = Rank(4, 2, 1, SRC_PAGES).layout.to_dict() | layout
    ident = dataclasses.asdict(pd.Identity(pd.PD_VERSION, "m", "bfloat16", PAGE, LAYERS, 4, DIM))
    body = {"name": "d", "identity": ident, "layout": half, "agent": "bWV0YQ==",
            "meta": {"addr": 4096, "slot_bytes": 344, "slots": 4}, "ranks": []}
    return json.dumps({"v": pd.PD_VERSION, "type": "Hello", "body": body}).encode()


def test_a_tp_layout_crosses_the_handshake_and_old_layout_dicts_still_load() -> None:
    msg = pd.decode(_hello())
    assert isinstance(msg, pd.Hello) and KVLayout(**msg.layout).heads == (2, 4)
    old = {k: v for k, v in msg.layout.items() if k not in ("head_start", "total_kv_heads")}
    assert KVLayout(**old).heads == (0, 2) and KVLayout(**old).total_heads == 2  # no TP: all of them
    assert pd.PD_VERSION >= 5  # the version that brought head ranges, or a later one


small_or_huge = st.integers(0, 8) | st.integers(0, 2**70)


@given(head_start=small_or_huge, num_kv_heads=small_or_huge, total_kv_heads=small_or_huge)
def test_a_head_range_outside_the_model_is_a_bad_message(head_start: int, num_kv_heads: int,
                                                         total_kv_heads: int) -> None:
    data = _hello(head_start=head_start, num_kv_heads=num_kv_heads, total_kv_heads=total_kv_heads)
    try:
        msg = pd.decode(data)
    except pd.BadMessage:
        return
    layout = KVLayout(**msg.layout)  # what passed the schema is a layout, never a ValueError
    assert layout.heads[1] <= layout.total_heads <= pd.MAX_KV_HEADS
