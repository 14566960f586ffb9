"""The KV transfer contract (tandem/pd/transfer/contract.py) over every implementation: whole
pages of every layer's K and V land in the peer's pages, the notification arrives after
them, nothing else is touched, mismatched layouts are refused; in one process and
between two processes (the real NIXL/UCX path, on CPU memory)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest
import torch
from waits import wait_until

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.pd.protocol import MetaRegion
from tandem.pd.transfer.contract import Events
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.pd.transfer.pages import descriptors, page_runs

nixl_agent = pytest.importorskip("tandem.pd.transfer.nixl_agent")
try:
    nixl_agent.nixl_api()
except ImportError:
    pytest.skip("NIXL is not installed", allow_module_level=True)

IMPLEMENTATIONS = {"nixl": nixl_agent.NixlTransfer}
SHAPE = dict(page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def pool(num_pages: int = 16, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", **kw: int) -> TokenToKVPool:
    pool = TokenToKVPool(num_pages=num_pages, dtype=dtype, device=device, **{**SHAPE, **kw})
    pool.kv_buffer.zero_()
    return pool


def pages(p: TokenToKVPool, ids: list[int]) -> torch.Tensor:
    P = p.page_size
    return torch.stack([p.kv_buffer[:, :, i * P : (i + 1) * P] for i in ids], dim=2)


def wait(t, pred, timeout: float = 20.0, also: tuple = ()):
    """Poll `t` until pred(its events so far); `also` are polled too (and their events kept
    in `backlog`): transfers advance only while both sides poll."""
    got = Events()

    def step() -> bool:
        ev = t.poll()
        got.sent += ev.sent
        got.received += ev.received
        for other in also:
            extra = other.poll()
            backlog.setdefault(id(other), Events()).sent.extend(extra.sent)
            backlog[id(other)].received.extend(extra.received)
        return pred(got)

    wait_until(step, timeout, "a matching transfer event", interval=0.001)
    return got


backlog: dict[int, Events] = {}


def take_backlog(t) -> Events:
    return backlog.pop(id(t), Events())


def test_page_runs_merge_consecutive_pages() -> None:
    assert page_runs([3, 4, 5, 9], [10, 11, 12, 2]) == [(3, 10, 3), (9, 2, 1)]
    assert page_runs([3, 4], [10, 12]) == [(3, 10, 1), (4, 12, 1)]
    a, b = pool().layout(), pool(num_pages=32).layout()
    src, dst = descriptors(a, b, [3, 4], [7, 8])
    assert len(src) == len(dst) == SHAPE["num_layers"] * 2
    assert tuple(src[0].tolist()) == (a.page_addr(0, 0, 3), 2 * a.page_bytes)
    with pytest.raises(ValueError, match="page 0"):
        descriptors(a, b, [0], [1])
    with pytest.raises(ValueError, match="head_dim"):
        descriptors(a, pool(head_dim=16).layout(), [1], [1])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_pages_land_with_their_notification(impl) -> None:
    src_pool, dst_pool = pool(), pool(num_pages=24)
    src_pool.kv_buffer.copy_(torch.randn_like(src_pool.kv_buffer, dtype=torch.float32))
    a, b = IMPLEMENTATIONS[impl]("p-" + impl), IMPLEMENTATIONS[impl]("d-" + impl)
    try:
        meta_a, meta_b = a.register(src_pool.layout()), b.register(dst_pool.layout())
        peer_b = a.add_peer(meta_b, dst_pool.layout())
        assert b.add_peer(meta_a, src_pool.layout()) == "p-" + impl
        src_ids, dst_ids = [3, 4, 7], [10, 11, 2]
        a.send(peer_b, "room-1", src_ids, dst_ids, b"room-1/last")
        ev = wait(a, lambda e: e.sent, also=(b,))
        assert ev.sent[0].room == "room-1" and ev.sent[0].ok, ev.sent
        early = take_backlog(b)
        got = early if early.received else wait(b, lambda e: e.received, also=(a,))
        assert got.received == [("p-" + impl, b"room-1/last")]
        assert torch.equal(pages(dst_pool, dst_ids), pages(src_pool, src_ids))
        untouched = [i for i in range(24) if i not in dst_ids]
        assert torch.count_nonzero(pages(dst_pool, untouched)) == 0
        with pytest.raises(ValueError, match="dtype"):
            a.add_peer(meta_b, pool(dtype=torch.float32).layout())
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_first_token_slot_lands_with_the_last_pages(impl) -> None:
    from tandem.pd.transfer.first_token import FirstTokenSlots

    src_pool, dst_pool = pool(), pool(num_pages=24)
    src_pool.kv_buffer.normal_()
    src_slots, dst_slots = FirstTokenSlots(4), FirstTokenSlots(8)
    a, b = IMPLEMENTATIONS[impl]("ps-" + impl), IMPLEMENTATIONS[impl]("ds-" + impl)
    try:
        meta_a = a.register(src_pool.layout(), src_slots.region())
        meta_b = b.register(dst_pool.layout(), dst_slots.region())
        peer_b = a.add_peer(meta_b, dst_pool.layout(), dst_slots.region())
        b.add_peer(meta_a, src_pool.layout(), src_slots.region())
        src_slots.write(2, 4242, -0.5, [(4242, -0.5), (7, -1.25)])
        with pytest.raises(ValueError, match="slot"):
            a.send(peer_b, "bad", [1], [1], b"", slot=(2, 8))
        a.send(peer_b, "room-2", [5, 6], [9, 3], b"room-2/last", slot=(2, 5))
        assert wait(a, lambda e: e.sent, also=(b,)).sent[0].ok
        early = take_backlog(b)
        got = early if early.received else wait(b, lambda e: e.received, also=(a,))
        assert got.received[0][1] == b"room-2/last"
        assert dst_slots.read(5) == (4242, -0.5, [(4242, -0.5), (7, -1.25)])
        assert torch.equal(pages(dst_pool, [9, 3]), pages(src_pool, [5, 6]))
    finally:
        a.close()
        b.close()


def _decode_side(conn, src_layout_dict: dict, device: str) -> None:
    from tandem.protocol.kv_layout import KVLayout

    dst = pool(num_pages=40, device=device)
    slots = FirstTokenSlots(4, device=device)
    t = nixl_agent.NixlTransfer("decode-proc")
    conn.send((t.register(dst.layout(), slots.region()), dst.layout().to_dict(), slots.region()))
    peer_meta, peer_slots = conn.recv()
    t.add_peer(peer_meta, KVLayout(**src_layout_dict), peer_slots)
    got = wait(t, lambda e: e.received, timeout=30)
    conn.send((got.received, pages(dst, [20, 21, 22, 5]).float().sum().item(),
               int(torch.count_nonzero(dst.kv_buffer)), slots.read(3)))
    t.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_between_two_processes(impl, device: str) -> None:
    """Pages and a first-token slot in one send, on host memory or VRAM to VRAM on one GPU."""
    from tandem.protocol.kv_layout import KVLayout

    src = pool(device=device)
    src.kv_buffer.copy_(torch.rand_like(src.kv_buffer, dtype=torch.float32) + 1)  # no zeros
    slots = FirstTokenSlots(4, device=device)
    slots.write(1, 4242, -0.5, [(4242, -0.5), (7, -2.25)])
    assert src.layout().mem_type == ("VRAM" if device == "cuda" else "DRAM")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(there, src.layout().to_dict(), device))
    proc.start()
    t = IMPLEMENTATIONS[impl]("prefill-proc")
    try:
        meta = t.register(src.layout(), slots.region())
        peer_meta, peer_layout, peer_slots = here.recv()
        peer = t.add_peer(peer_meta, KVLayout(**peer_layout), peer_slots)
        here.send((meta, slots.region()))
        t.send(peer, "r7", [1, 2, 3, 9], [20, 21, 22, 5], b"r7", slot=(1, 3))
        assert wait(t, lambda e: e.sent).sent[0].ok
        assert here.poll(30), "the decode process did not answer"
        received, total, nonzero, first = here.recv()
        assert received == [("prefill-proc", b"r7")]
        assert total == pytest.approx(pages(src, [1, 2, 3, 9]).float().sum().item(), rel=1e-6)
        assert nonzero == pages(src, [1, 2, 3, 9]).numel()  # nothing else was written
        assert first == (4242, -0.5, [(4242, -0.5), (7, -2.25)])
    finally:
        t.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_the_layout_says_where_the_kv_lives_and_a_host_peer_cannot_pair_with_a_gpu_peer() -> None:
    layout = pool().layout()
    assert (layout.mem_type, layout.device_id) == ("DRAM", 0)
    gpu = dataclasses.replace(layout, mem_type="VRAM", device_id=1)
    assert layout.mismatch(gpu) == ["mem_type: DRAM != VRAM"]
    assert not gpu.mismatch(dataclasses.replace(gpu, device_id=0))  # another GPU of the peer: fine
    t = nixl_agent.NixlTransfer("where-a")
    try:
        t.register(layout)
        with pytest.raises(ValueError, match="mem_type"):
            t.add_peer(b"unused", gpu)
    finally:
        t.close()


class _Recorder:
    """Stands in for the NIXL agent: records the memory type and device of every descriptor."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []

    def get_reg_descs(self, regions, mem_type):
        self.calls.append(("reg", mem_type, [r[2] for r in regions]))

    def get_xfer_descs(self, descs, mem_type):
        self.calls.append(("xfer", mem_type, sorted({d[2] for d in descs})))

    def register_memory(self, descs): return "reg"
    def get_agent_metadata(self): return b"meta"
    def add_remote_agent(self, meta): return b"peer"
    def initialize_xfer(self, *args): return "handle"
    def transfer(self, handle): return "PROC"
    def release_xfer_handle(self, handle): pass
    def remove_remote_agent(self, peer): pass
    def deregister_memory(self, reg): pass


def test_descriptors_carry_each_sides_memory_type_and_device() -> None:
    """VRAM on GPU 1 here, VRAM on GPU 2 at the peer: registration and source descriptors
    name this side's device, destination descriptors the peer's (not the local type, not 0)."""
    t = nixl_agent.NixlTransfer("where-b")
    t.agent = rec = _Recorder()
    here = dataclasses.replace(pool().layout(), mem_type="VRAM", device_id=1)
    there = dataclasses.replace(here, device_id=2, base_ptr=here.base_ptr + 4096)
    slots = MetaRegion(1 << 20, 8 * 43, 4)
    t.register(here, slots)
    peer = t.add_peer(b"meta", there, slots)
    t.send(peer, "r1", [1, 2], [3, 4], b"r1", slot=(0, 1))
    assert rec.calls == [("reg", "VRAM", [1, 1]), ("xfer", "VRAM", [1]), ("xfer", "VRAM", [2])]


def test_first_token_slots_live_on_the_kv_device() -> None:
    slots = FirstTokenSlots(2, device="meta")  # any device: the KV buffer's, so one NIXL list holds both
    assert slots.buf.device.type == "meta"


def test_nixl_errors_fail_the_peer_or_the_send_never_the_caller(monkeypatch) -> None:
    """NIXL's own exceptions (nixlMismatchError, nixlBackendError, ...) come out as TransferError
    (a refused peer or send) or a failed SendDone: the scheduler loop calling them goes on."""
    from tandem.pd.transfer.contract import SendDone, TransferError

    pools = pool(), pool()  # held: their buffers stay registered
    layout, other_layout = pools[0].layout(), pools[1].layout()
    t, other = nixl_agent.NixlTransfer("errs-a"), nixl_agent.NixlTransfer("errs-b")
    try:
        meta_a, meta_b = t.register(layout), other.register(other_layout)
        other.add_peer(meta_a, layout)
        with pytest.raises(TransferError, match="nixlMismatchError"):
            t.add_peer(b"junk" * 8, other_layout)  # garbage agent metadata from a peer
        peer = t.add_peer(meta_b, other_layout)
        boom = next(e for e in t.errors if e.__name__ == "nixlBackendError")

        def fail(*args, **kw):
            raise boom("NIXL_ERR_BACKEND")

        with monkeypatch.context() as m:
            m.setattr(t.agent, "initialize_xfer", fail)
            with pytest.raises(TransferError, match="nixlBackendError"):
                t.send(peer, "r1", [1], [1], b"r1")
        t.send(peer, "r2", [1], [1], b"r2")
        with monkeypatch.context() as m:
            for name in ("check_xfer_state", "get_new_notifs", "remove_remote_agent"):
                m.setattr(t.agent, name, fail)
            events = t.poll()
            assert events.sent == [SendDone("r2", False, "transfer failed: nixlBackendError")]
            assert events.received == []
            t.remove_peer(peer)  # logged, forgotten
        assert peer not in t.peers and not t.pending
    finally:
        t.close()
        other.close()
