"""The KV tiers' copy queue (kvcache/tier_copies.py): copies run in the order they were queued,
layer by layer, off the scheduler's thread; a forward waits for a layer only, and a copier that
lags behind the forward changes no token (the forward waits for it: stalls are counted)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from waits import wait_until

from tandem.engine.kvcache import tier_copies
from tandem.engine.kvcache.tier_copies import CopyOp, ThreadCopies

L, PAGES, BYTES = 3, 24, 16


def _buf(fill: int | None = None) -> torch.Tensor:
    if fill is None:
        return torch.randint(0, 255, (L, 2, PAGES, BYTES), dtype=torch.uint8)
    return torch.full((L, 2, PAGES, BYTES), fill, dtype=torch.uint8)


@pytest.mark.parametrize("pages", [[2, 3], list(range(0, 20, 2))], ids=["runs", "scattered"])
def test_a_page_is_read_before_a_later_op_overwrites_it(pages: list[int]) -> None:
    """A device page evicted (its write to the host queued) and handed at once to a load: the
    write reads the old bytes, then the load lands, in every layer."""
    dev, host, incoming = _buf(), _buf(0), _buf()
    old = dev.clone()
    copies = ThreadCopies(L)
    slots = list(range(len(pages)))
    copies.add(CopyOp(dev, pages, host, slots, "write"))
    copies.add(CopyOp(incoming, slots, dev, pages, "load"))
    job = copies.launch()
    assert job is not None
    job.wait_all()
    assert torch.equal(host[:, :, slots], old[:, :, pages])
    assert torch.equal(dev[:, :, pages], incoming[:, :, slots])
    copies.close()


@pytest.mark.gpu
def test_on_cuda_a_side_stream_copies_in_order_and_the_forward_stream_waits() -> None:
    """StreamCopies: the same order as the thread's, from pinned host memory, a layer's event
    waited on by the caller's stream."""
    pages = [2, 3, 9]
    dev = _buf().cuda()
    host, incoming = _buf(0).pin_memory(), _buf().pin_memory()
    old = dev.cpu()
    copies = tier_copies.tier_copies(L, dev.device)
    slots = list(range(len(pages)))
    copies.add(CopyOp(dev, pages, host, slots, "write"))
    copies.add(CopyOp(incoming, slots, dev, pages, "load"))
    job = copies.launch()
    assert job is not None
    for layer in range(L):
        job.wait(layer)
        assert torch.equal(dev[layer, :, pages].cpu(), incoming[layer, :, slots])  # ordered on this stream
    copies.drain()
    assert torch.equal(host[:, :, slots], old[:, :, pages])


def _gated(monkeypatch: pytest.MonkeyPatch) -> list[threading.Event]:
    """Hold the copier before each layer until the test opens that layer's gate."""
    gates = [threading.Event() for _ in range(L)]
    copy_layer = ThreadCopies._copy_layer

    def gated(self, layer, views):  # type: ignore[no-untyped-def]
        assert gates[layer].wait(10), "the test never opened this layer"
        copy_layer(self, layer, views)

    monkeypatch.setattr(ThreadCopies, "_copy_layer", gated)
    return gates


def test_a_forward_waits_for_its_layer_not_the_whole_load(monkeypatch: pytest.MonkeyPatch) -> None:
    gates = _gated(monkeypatch)
    dev, host = _buf(0), _buf()
    copies = ThreadCopies(L)
    copies.add(CopyOp(host, [0, 1], dev, [5, 6], "load"))
    job = copies.launch()
    assert job is not None
    reached: list[int] = []

    def forward() -> None:
        for layer in range(L):
            job.wait(layer)
            assert torch.equal(dev[layer, :, 5:7], host[layer, :, 0:2])  # this layer has landed
            reached.append(layer)

    t = threading.Thread(target=forward)
    t.start()
    gates[0].set()
    wait_until(lambda: reached == [0], 10, "the forward past layer 0")
    time.sleep(0.05)  # sleep-ok: proves a negative, that the forward stays at layer 1 while its gate is shut
    assert reached == [0] and not job.done()  # layer 1 is still loading: the forward waits there
    gates[1].set()
    gates[2].set()
    t.join(10)
    assert reached == [0, 1, 2] and job.done() and copies.stall_seconds > 0
    assert copies.launch() is None  # nothing in flight any more
    copies.close()


def test_a_failed_copy_fails_its_waiter_and_the_next_job_runs() -> None:
    dev, host = _buf(0), _buf()
    copies = ThreadCopies(L)
    copies.add(CopyOp(host, [0], torch.zeros((L, 2, PAGES, BYTES + 1), dtype=torch.uint8), [0], "load"))
    job = copies.launch()
    assert job is not None
    with pytest.raises(RuntimeError, match="a KV tier copy failed"):
        job.wait(0)
    copies.add(CopyOp(host, [3], dev, [4], "load"))
    copies.drain()
    assert torch.equal(dev[:, :, 4], host[:, :, 3])
    copies.close()


def test_the_copier_thread_ends_when_idle_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_copies, "IDLE_EXIT_S", 0.05)
    dev, host = _buf(0), _buf()
    copies = ThreadCopies(L)
    for page in (1, 2):
        copies.add(CopyOp(host, [page], dev, [page], "load"))
        copies.drain()
        wait_until(lambda: copies._thread is None, 10, "the idle copier thread to end")
    assert torch.equal(dev[:, :, 1:3], host[:, :, 1:3])


def test_a_spill_hands_on_the_bytes_once_they_are_copied() -> None:
    dev, got = _buf(), []
    copies = ThreadCopies(L)
    staging = tier_copies.staging(L, 2, BYTES, pinned=False)
    copies.add(CopyOp(dev, [7, 3], staging, [0, 1], "spill",
                      then=lambda: got.extend(staging[:, :, i].contiguous().numpy().tobytes() for i in (0, 1))))
    copies.drain()
    assert got == [dev[:, :, 7].contiguous().numpy().tobytes(), dev[:, :, 3].contiguous().numpy().tobytes()]
    back = tier_copies.from_payloads(got, L, pinned=False)
    assert torch.equal(back, dev[:, :, [7, 3]])


# ---- in the engine --------------------------------------------------------------------------------
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _chats(n: int) -> list[list[int]]:
    return [list(range(300, 340)) + [1000 + 37 * c + j for j in range(30)] for c in range(n)]


def _two_turns(eng, chats: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Every first turn, then every second: by then the pool has evicted most first turns."""
    firsts = [eng.generate([c], SP)[0]["token_ids"] for c in chats]
    return firsts + [eng.generate([c + f + list(range(2000, 2010))], SP)[0]["token_ids"]
                     for c, f in zip(chats, firsts)]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_copier_behind_the_forward_changes_no_token(engine, monkeypatch: pytest.MonkeyPatch,
                                                     overlap: bool) -> None:
    """Every layer's copy takes 3 ms longer than it would: the forwards that launch with loads
    reach a layer before it lands and wait (stall_seconds > 0), and answer as without the tier."""
    chats = _chats(6)
    base = dict(max_total_tokens=160, page_size=4, disable_overlap_schedule=not overlap)
    want = _two_turns(engine(**base), chats)
    copy_layer = ThreadCopies._copy_layer

    def slow(self, layer, views):  # type: ignore[no-untyped-def]
        time.sleep(0.003)  # sleep-ok: the copier made slower than the forward, on purpose
        copy_layer(self, layer, views)

    monkeypatch.setattr(ThreadCopies, "_copy_layer", slow)
    tiered = engine(**base, enable_hierarchical_cache=True, hicache_ratio=8.0, hicache_write_policy="write_back")
    assert _two_turns(tiered, chats) == want
    host = tiered.status()[0].info["host_tier"]
    assert host["loaded_tokens"] > 0 and host["stall_seconds"] > 0, host
