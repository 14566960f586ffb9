"""RankSends (prefill/rank_sends.py) over a scripted transfer: gather writes go staged, wait in
order while the pool has no room and start as earlier writes are reported; a write that can
never fit, or finds no room with nothing staged in flight, goes as slices; a refused write
fails its chunk and drops its waiting writes; every chunk ends reported once, with its
staging free."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from kv_caches import cache_over

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.parallel.group import SINGLE
from tandem.pd.agree import Agreement
from tandem.pd.parts import Link
from tandem.pd.transfer.contract import Events, SendDone
from tandem.pd.transfer.head_map import Write
from tandem.prefill.rank_sends import RankSends
from tandem.prefill.staging import SliceStaging

PAGE, HEADS = 4, 4
HALVES = Link((Write(0, 0, (0, 2), True, gather=True), Write(0, 1, (2, 4), True, gather=True)), {0: "d0", 1: "d1"})


class Transfer:
    """Records sends; the test says which chunks finish (`done`) and which peers are unknown."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bool]] = []  # (peer, chunk key, staged)
        self.finished: list[SendDone] = []
        self.reported: list[tuple[str, str, bool]] = []
        self.unknown: set[str] = set()

    def send(self, peer, room, src_pages, dst_pages, notify, slot=None, heads=None, source=None, dest=None) -> None:
        if peer in self.unknown:
            raise KeyError(f"unknown peer {peer!r}")
        self.sent.append((peer, room, source is not None))

    def done(self, key: str, ok: bool = True) -> None:
        """Every write of chunk `key` sent so far (and not reported yet) reports."""
        reported = {id(x) for x in self.reported}
        for x in self.sent:
            if x[1] == key and id(x) not in reported:
                self.finished.append(SendDone(key, ok, "" if ok else "boom"))
                self.reported.append(x)

    def poll(self) -> Events:
        events, self.finished = Events(sent=self.finished), []
        return events


def sends(pool_pages: int) -> tuple[RankSends, Transfer]:
    """Over a pool of `pool_pages` usable pages, 8 of them taken by the requests being sent."""
    pool = TokenToKVPool(num_pages=pool_pages + 9, page_size=PAGE, num_layers=2, num_kv_heads=HEADS, head_dim=8,
                         dtype=torch.bfloat16, device="cpu")
    cache = cache_over(pool)
    cache.allocator.alloc_pages(8)
    t = Transfer()
    return RankSends(t, Agreement(SINGLE), SliceStaging(cache)), t


def test_a_full_pool_holds_the_next_chunks_writes_until_the_first_is_reported() -> None:
    rs, t = sends(4)  # 4 pages: a 4-page chunk's two halves (2 pool pages each) at a time
    rs.start("1:1", HALVES, [1, 2, 3, 4], [5, 6, 7, 8], b"n", (0, 0))
    rs.start("1:2", HALVES, [9, 10, 11, 12], [13, 14, 15, 16], b"n", None)
    assert t.sent == [("d0", "1:1", True), ("d1", "1:1", True)]
    assert len(rs.waiting) == 2 and rs.stats["waited_for_staging"] == 2
    assert rs.poll() == []
    t.done("1:1")
    assert rs.poll() == [("1:1", "")]
    assert t.sent[2:] == [("d0", "1:2", True), ("d1", "1:2", True)] and not rs.waiting
    t.done("1:2")
    assert rs.poll() == [("1:2", "")]
    assert not rs.open
    rs.staging.check_integrity()


def test_a_write_larger_than_the_pool_goes_as_slices() -> None:
    rs, t = sends(1)
    rs.start("2:1", HALVES, list(range(1, 9)), list(range(20, 28)), b"n", None)
    assert t.sent == [("d0", "2:1", False), ("d1", "2:1", False)] and rs.stats["unstaged_sends"] == 2
    t.done("2:1")
    assert rs.poll() == [("2:1", "")]
    rs.staging.check_integrity()


def test_a_write_waits_only_for_staging_another_chunk_holds() -> None:
    """Frees come only when a chunk ends: the chunk's own staged write, or a pool full of
    requests, would never free room for it, so it goes as slices instead of waiting forever."""
    rs, t = sends(3)  # room for the first half's 2 pool pages, not the second's
    rs.start("4:1", HALVES, [1, 2, 3, 4], [5, 6, 7, 8], b"n", None)
    assert t.sent == [("d0", "4:1", True), ("d1", "4:1", False)] and not rs.waiting
    t.done("4:1")
    assert rs.poll() == [("4:1", "")]
    assert rs.staging.cache.alloc_staging(3) is not None  # requests fill the pool; nothing staged in flight
    rs.start("4:2", HALVES, [1, 2, 3, 4], [5, 6, 7, 8], b"n", None)
    assert t.sent[2:] == [("d0", "4:2", False), ("d1", "4:2", False)] and rs.stats["unstaged_sends"] == 3


@pytest.mark.parametrize("fail", ["refused", "transfer"])
def test_a_failed_chunk_sends_nothing_more_and_frees_its_staging(fail: str) -> None:
    """Under TP the ranks stage alike whatever their own NIXL said: a failed chunk's waiting
    writes are still staged in turn (and freed with the chunk), just not sent."""
    rs, t = sends(4)
    rs.start("3:1", HALVES, [1, 2, 3, 4], [5, 6, 7, 8], b"n", None)
    if fail == "refused":  # the second chunk's decode rank 1 vanished: its write is refused when started
        t.unknown.add("d1")
    rs.start("3:2", HALVES, [9, 10, 11, 12], [13, 14, 15, 16], b"n", None)
    t.done("3:1", ok=fail != "transfer")
    reports = rs.poll()
    assert reports == [("3:1", "KV transfer failed: boom" if fail == "transfer" else "")]
    t.done("3:2")
    reports = rs.poll()
    assert reports[0][0] == "3:2" and (fail == "transfer" or "unknown peer 'd1'" in reports[0][1])
    assert ("d1", "3:2", True) not in t.sent or fail == "transfer"
    assert not rs.open and not rs.waiting
    rs.staging.check_integrity()


def test_a_refused_write_leaves_the_chunks_later_writes_unsent() -> None:
    rs, t = sends(1)  # no staging: both go as slices
    t.unknown.add("d0")
    rs.start("5:1", HALVES, list(range(1, 9)), list(range(20, 28)), b"n", None)
    assert t.sent == []
    assert rs.poll()[0][0] == "5:1" and not rs.open


class ThreadRanks:
    """A TP group of threads: all_gather_bytes meets at a barrier (what gloo does across processes)."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [b""] * size, threading.Barrier(size)

    def rank(self, r: int) -> SimpleNamespace:
        def all_gather_bytes(data: bytes) -> list[bytes]:
            self.slots[r] = data
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return SimpleNamespace(size=self.size, rank=r, all_gather_bytes=all_gather_bytes)


class LateTransfer(Transfer):
    """Reports each send `delay` polls after it was made."""

    def __init__(self, delay: int) -> None:
        super().__init__()
        self.delay, self.age = delay, 0
        self.made: list[tuple[int, str]] = []

    def send(self, peer, room, *args, **kw) -> None:
        super().send(peer, room, *args, **kw)
        self.made.append((self.age, room))

    def poll(self) -> Events:
        self.age += 1
        due = [room for at, room in self.made if self.age - at >= self.delay]
        self.made = [(at, room) for at, room in self.made if self.age - at < self.delay]
        return Events(sent=[SendDone(room, True) for room in due])


def test_tp_ranks_stage_and_free_alike_whenever_their_own_nixl_reports() -> None:
    """Prefill TP 2 -> decode TP 4: each prefill rank gathers two slices per chunk. Rank 1's
    NIXL reports three polls after rank 0's; their pools (what the scheduler decides from)
    must stay alike all along, and the waiting writes start in the same poll on both."""
    group = ThreadRanks(2)
    link = Link((Write(0, 0, (0, 1), True, gather=True), Write(0, 1, (1, 2), True, gather=True)),
                {0: "d0", 1: "d1"})
    trace: list[list] = [[], []]

    def rank(r: int) -> None:
        rs, _ = sends(2)  # one chunk's two halves at a time: later chunks wait
        rs.transfer = LateTransfer(delay=1 + 3 * r)
        rs.agree = Agreement(group.rank(r))
        for c in range(4):
            rs.start(f"9:{c}", link, [1, 2, 3, 4], [5, 6, 7, 8], b"n", None)
        for _ in range(30):
            rs.poll()
            trace[r].append((rs.staging.cache.allocator.available_size(), len(rs.waiting), sorted(rs.staging.held)))
        assert not rs.open and not rs.waiting
        rs.staging.check_integrity()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert trace[0] and trace[0] == trace[1]
