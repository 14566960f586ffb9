"""RankSends (prefill/rank_sends.py) over a scripted transfer: gather writes go staged, wait in
order while the staging buffer is busy and start as earlier chunks are reported; a write that
can never fit goes as slices; a refused write fails its chunk and drops its waiting writes;
every chunk ends reported once, with its staging free."""

from __future__ import annotations

import pytest
import torch

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
    """Records sends; the test says which finish (`done`) and which peers are unknown."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bool]] = []  # (peer, key, staged)
        self.finished: list[SendDone] = []
        self.unknown: set[str] = set()

    def add_staging(self, addr: int, nbytes: int) -> None:
        pass

    def send(self, peer, room, src_pages, dst_pages, notify, slot=None, heads=None, source=None) -> None:
        if peer in self.unknown:
            raise KeyError(f"unknown peer {peer!r}")
        self.sent.append((peer, room, source is not None))

    def done(self, key: str, ok: bool = True) -> None:
        self.finished += [SendDone(key, ok, "" if ok else "boom") for p, k, _ in self.sent if k == key]

    def poll(self) -> Events:
        events, self.finished = Events(sent=self.finished), []
        return events


def sends(chunk_pages: int) -> tuple[RankSends, Transfer]:
    pool = TokenToKVPool(num_pages=64, page_size=PAGE, num_layers=2, num_kv_heads=HEADS, head_dim=8,
                         dtype=torch.bfloat16, device="cpu")
    t = Transfer()
    staging = SliceStaging(pool, t, 0)
    capacity = 2 * staging._staged(chunk_pages, (0, 2)).total_bytes  # one chunk's two halves
    return RankSends(t, Agreement(SINGLE), SliceStaging(pool, t, capacity)), t


def test_a_busy_buffer_holds_the_next_chunks_writes_until_the_first_is_reported() -> None:
    rs, t = sends(4)
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


def test_a_write_larger_than_the_buffer_goes_as_slices() -> None:
    rs, t = sends(1)
    rs.start("2:1", HALVES, list(range(1, 9)), list(range(20, 28)), b"n", None)
    assert t.sent == [("d0", "2:1", False), ("d1", "2:1", False)] and rs.stats["unstaged_sends"] == 2
    t.done("2:1")
    assert rs.poll() == [("2:1", "")]
    rs.staging.check_integrity()


@pytest.mark.parametrize("fail", ["refused", "transfer"])
def test_a_failed_chunk_drops_its_waiting_writes_and_frees_its_staging(fail: str) -> None:
    rs, t = sends(4)
    rs.start("3:1", HALVES, [1, 2, 3, 4], [5, 6, 7, 8], b"n", None)
    if fail == "refused":  # the second chunk's decode rank 1 vanished: its write is refused when started
        t.unknown.add("d1")
    rs.start("3:2", HALVES, [9, 10, 11, 12], [13, 14, 15, 16], b"n", None)
    t.done("3:1", ok=fail != "transfer")
    reports = rs.poll()
    if fail == "transfer":
        assert reports == [("3:1", "KV transfer failed: boom")]
        t.done("3:2")
        reports = rs.poll()
        assert reports == [("3:2", "")]
    else:
        assert reports[0] == ("3:1", "")
        t.done("3:2")
        reports += rs.poll()
        assert reports[1][0] == "3:2" and "unknown peer 'd1'" in reports[1][1]
        assert ("d1", "3:2", True) not in t.sent
    assert not rs.open and not rs.waiting
    rs.staging.check_integrity()
