"""KVTransfer over NIXL (UCX backend): host memory on a CPU worker, GPU memory on a GPU.

NIXL ships one wheel per CUDA major (nixl_cu12, nixl_cu13, or the `nixl` meta package);
whichever is installed is used. A send is one NIXL WRITE transfer of all its page runs or
head slices (tandem/pd/transfer/pages.py) carrying `notify`, which NIXL delivers after the data.

Where memory lives comes from the layouts (KVLayout.mem_type, device_id): this side's
registration and source descriptors use its own, the destination descriptors the peer's.
A NIXL descriptor list holds one memory type, so the first-token slots live on the KV
buffer's device (FirstTokenSlots) and travel in the same list as the pages.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.pd.protocol import MetaRegion
from tandem.pd.transfer.contract import Events, KVTransfer, SendDone, TransferError
from tandem.pd.transfer.pages import Descs, descriptors, page_runs
from tandem.protocol.kv_layout import HeadRange, KVLayout

log = logging.getLogger(__name__)


def nixl_api() -> Any:
    """The nixl._api module of whichever NIXL wheel is installed."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise ImportError("NIXL is not installed: pip install nixl-cu12 (or nixl-cu13 on CUDA 13)")


def nixl_errors(api: Any) -> tuple[type[Exception], ...]:
    """NIXL's own exception types (nixlBackendError, nixlInvalidParamError, ...), from the
    bindings beside `api`, plus the RuntimeError its Python layer raises."""
    bindings = importlib.import_module(api.__name__.rsplit(".", 1)[0] + "._bindings")
    own = [v for k, v in vars(bindings).items() if k.startswith("nixl") and isinstance(v, type)
           and issubclass(v, Exception)]
    return (*own, RuntimeError)


@dataclass
class _Pending:
    room: str
    peer: str
    handle: Any
    started: float


class NixlTransfer(KVTransfer):
    def __init__(self, name: str, timeout: float = 30.0, progress_thread: bool = False) -> None:
        api = nixl_api()
        # NIXL's progress thread busy-polls a core. On a CPU worker that core is the model's:
        # with two agents' threads spinning, a same-machine memcpy ran at 1.6 instead of
        # ~30 GB/s. Without it, poll() (check_xfer_state, get_new_notifs) drives progress.
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = api.nixl_agent(name, config)
        self.errors = nixl_errors(api)
        self.name = name
        self.timeout = timeout
        self.layout: KVLayout | None = None
        self.slots: MetaRegion | None = None
        self._reg: Any = None
        self.peers: dict[str, tuple[KVLayout, MetaRegion | None]] = {}
        self.pending: list[_Pending] = []
        self._failed: list[SendDone] = []

    def register(self, layout: KVLayout, slots: MetaRegion | None = None) -> bytes:
        if self.layout is not None:
            raise RuntimeError("the KV buffer is registered already")
        self.layout, self.slots = layout, slots
        regions = [(layout.base_ptr, layout.total_bytes, layout.device_id, "")]
        if slots is not None:  # on the KV buffer's device (one memory type per list)
            regions.append((slots.addr, slots.slot_bytes * slots.slots, layout.device_id, ""))
        descs = self.agent.get_reg_descs(regions, layout.mem_type)
        self._reg = self.agent.register_memory(descs)
        return self.agent.get_agent_metadata()

    @staticmethod
    def _view(view: KVLayout | None, of: KVLayout, side: str) -> KVLayout:
        """`of`, or `view` where it is `of` seen at a slice's width (KVLayout.sliced)."""
        if view is None:
            return of
        if (view.base_ptr, view.total_bytes, view.mem_type, view.device_id) != (
                of.base_ptr, of.total_bytes, of.mem_type, of.device_id):
            raise ValueError(f"the send's {side} is not a view of that side's registered KV buffer")
        return view

    def add_peer(self, metadata: bytes, layout: KVLayout, slots: MetaRegion | None = None) -> str:
        if self.layout is None:
            raise RuntimeError("register() first")
        problems = self.layout.mismatch(layout)
        if problems:
            raise ValueError("KV layouts differ: " + "; ".join(problems))
        try:
            peer = self.agent.add_remote_agent(metadata)
        except self.errors as exc:
            raise TransferError(f"NIXL refused the peer's agent metadata ({type(exc).__name__})") from None
        name = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.peers[name] = (layout, slots)
        return name

    def send(self, peer: str, room: str, src_pages: Sequence[int], dst_pages: Sequence[int],
             notify: bytes, slot: tuple[int, int] | None = None, heads: HeadRange | None = None,
             source: KVLayout | None = None, dest: KVLayout | None = None) -> None:
        if self.layout is None:
            raise RuntimeError("register() first")
        if peer not in self.peers:
            raise KeyError(f"unknown peer {peer!r}")
        peer_layout, peer_slots = self.peers[peer]
        src, dst = descriptors(self._view(source, self.layout, "source"), self._view(dest, peer_layout, "destination"),
                               src_pages, dst_pages, heads)
        self.runs_sent += len(page_runs(src_pages, dst_pages))
        self.bytes_sent += int(src[:, 1].sum())
        if slot is not None:
            if self.slots is None or peer_slots is None or self.slots.slot_bytes != peer_slots.slot_bytes:
                raise ValueError("first-token slots are not registered on both sides, or differ in size")
            if not (0 <= slot[0] < self.slots.slots and 0 <= slot[1] < peer_slots.slots
                    and peer_slots.addr + peer_slots.slots * peer_slots.slot_bytes <= 2**64):
                raise ValueError(f"slot {slot} outside the registered slots")
            n = self.slots.slot_bytes
            src = np.vstack([src, np.array([[self.slots.addr + slot[0] * n, n]], dtype=np.uint64)])
            dst = np.vstack([dst, np.array([[peer_slots.addr + slot[1] * n, n]], dtype=np.uint64)])
        if not len(src):
            raise ValueError("a send of nothing: no pages and no slot")
        handle = None
        try:
            local = self.agent.get_xfer_descs(_on(src, self.layout.device_id), self.layout.mem_type)
            remote = self.agent.get_xfer_descs(_on(dst, peer_layout.device_id), peer_layout.mem_type)
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer, notify)
            state = self.agent.transfer(handle)
        except self.errors as exc:
            if handle is not None:
                self._release(handle)
            raise TransferError(f"NIXL refused the transfer ({type(exc).__name__}: {exc})") from None
        if state == "ERR":
            self._release(handle)
            self._failed.append(SendDone(room, False, "NIXL refused the transfer"))
            return
        self.pending.append(_Pending(room, peer, handle, time.monotonic()))

    def poll(self) -> Events:
        events = Events(sent=self._failed)
        self._failed = []
        still: list[_Pending] = []
        now = time.monotonic()
        for p in self.pending:
            error = ""
            try:
                state = self.agent.check_xfer_state(p.handle)
            except self.errors as exc:
                state, error = "ERR", f": {type(exc).__name__}"
            if state == "DONE":
                events.sent.append(SendDone(p.room, True))
            elif state == "ERR" or now - p.started > self.timeout:
                error = "transfer failed" + error if state == "ERR" else f"no completion within {self.timeout:.0f} s"
                events.sent.append(SendDone(p.room, False, error))
            else:
                still.append(p)
                continue
            self._release(p.handle)
        self.pending = still
        try:
            notes = self.agent.get_new_notifs()
        except self.errors as exc:  # those pending come back next time, or time out
            log.error("NIXL notifications not read: %r", exc)
            notes = {}
        for peer, msgs in notes.items():
            events.received += [(peer, m) for m in msgs]
        return events

    def _release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # a handle of a dead peer may refuse release; it is dropped either way
            pass

    def remove_peer(self, peer: str) -> None:
        for p in [p for p in self.pending if p.peer == peer]:
            self._release(p.handle)
            self._failed.append(SendDone(p.room, False, f"peer {peer} removed"))
        self.pending = [p for p in self.pending if p.peer != peer]
        if self.peers.pop(peer, None) is not None:
            try:
                self.agent.remove_remote_agent(peer)
            except self.errors as exc:  # forgotten here either way: nothing is sent to it again
                log.warning("NIXL did not remove peer %s: %r", peer, exc)

    def close(self) -> None:
        for peer in list(self.peers):
            self.remove_peer(peer)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None


def _on(descs: Descs, device_id: int) -> np.ndarray:
    """NIXL's (n, 3) rows: address, bytes, device."""
    return np.column_stack([descs, np.full(len(descs), device_id, dtype=np.uint64)])
