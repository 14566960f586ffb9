"""The KV transfer contract: one-sided WRITEs of KV pages (whole, or some of their heads)
into a peer's pool.

Every implementation (today: NIXL, nixl_agent.py) behaves as stated here, and
tests/pd/test_kv_transfer.py (tests/pd/test_kv_transfer_tp.py: across TP sizes) runs the
same contract test over each.

    t = Transfer(name)
    meta = t.register(pool.layout(), slots)   # once: the KV buffer (+ first-token slots)
    peer = t.add_peer(peer_meta, peer_layout, peer_slots)  # once per peer; checks layouts match
    t.send(peer, room, src_pages, dst_pages, notify, slot=(src, dst), heads=(h0, h1))  # starts the WRITEs
    t.poll()                                  # -> Events: finished sends, notifications received
    t.send(peer, room, src, dst, notify, heads=(h0, h1), source=mine.sliced(h), dest=theirs.sliced(h))

Side effects the callers rely on:
- `send` moves every layer's K and V of each source page into the matching destination
  page, and with `slot` one first-token slot (tandem.pd.protocol.MetaRegion), in the
  same transfer: the notification covers both. The caller keeps the source pages
  allocated (and unmodified) until `poll` reports
  that room's send finished, ok or not: the engine reads them asynchronously.
- Tensor parallelism: each TP rank is its own transfer agent holding a range of the model's
  KV heads (KVLayout.heads). `heads` names the model's heads a send moves, held by both
  sides; the default is every head the peer holds. Between TP sizes that differ, prefill
  rank p sends decode rank d the heads tandem/pd/transfer/head_map.plan_writes gives the
  pair, so each decode head is written once. The first-token slot goes with exactly one
  send per (room, decode rank): the plan's `Write.slot` one (the lowest prefill rank writing
  that decode rank); the others pass slot=None. Notifications are per sender: a decode rank
  written by several prefill ranks has all of a room's bytes once each of them has notified.
- Staged slices: `source` (this side's KV buffer) and `dest` (the peer's) may be given seen
  at a slice's width (KVLayout.sliced): then src_pages / dst_pages are pages of that view,
  where a PD role packed or will unpack the slice (prefill/staging.py, decode/staging.py), and
  the send moves them as whole page runs instead of one descriptor per token. Either must
  be a view of that side's registered buffer (its address and size), nothing else.
- The peer receives `notify` only after all bytes of that send have landed, so a receiver
  that has seen a room's last notification may read its pages.
- A send that has not finished within `timeout` seconds is reported failed and its
  resources released; nothing waits forever.
- Transfers advance while `poll` is called, on both sides: a sender until its sends are
  reported, a receiver until the notifications it waits for arrive (decode's transfer
  queue polls every loop iteration while it has requests in it). No core spins otherwise.
- Errors of the engine underneath (NIXL's nixlBackendError, ...) never escape as their own
  types: `add_peer` and `send` raise TransferError (a ValueError: that peer or that send
  fails), `poll` reports a failed send, `remove_peer` and `close` log. A bad peer or a bad
  transfer fails its request, never the scheduler loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.pd.protocol import MetaRegion
from tandem.protocol.kv_layout import HeadRange, KVLayout


class TransferError(ValueError):
    """The transfer engine refused a peer or a send (its own error is the message)."""


@dataclass(frozen=True)
class SendDone:
    room: str
    ok: bool
    error: str = ""


@dataclass
class Events:
    sent: list[SendDone] = field(default_factory=list)
    received: list[tuple[str, bytes]] = field(default_factory=list)  # (peer name, notify)


class KVTransfer(ABC):
    runs_sent = 0  # runs of consecutive pages sent (whole slots: one descriptor per layer and K/V each)
    bytes_sent = 0  # KV bytes sent (head slices move less than page_bytes per page)

    @abstractmethod
    def register(self, layout: KVLayout, slots: MetaRegion | None = None) -> bytes:
        """Register the local KV buffer (and first-token slots); return this agent's metadata."""

    @abstractmethod
    def add_peer(self, metadata: bytes, layout: KVLayout, slots: MetaRegion | None = None) -> str:
        """Know a peer (its metadata and KV layout); return its name. Raises ValueError
        when the layouts cannot exchange pages (KVLayout.mismatch), TransferError when the
        engine refuses the metadata."""

    @abstractmethod
    def send(self, peer: str, room: str, src_pages: Sequence[int], dst_pages: Sequence[int],
             notify: bytes, slot: tuple[int, int] | None = None, heads: HeadRange | None = None,
             source: KVLayout | None = None, dest: KVLayout | None = None) -> None:
        """Start writing the model's KV `heads` (None: all the peer holds) of src_pages into the
        peer's dst_pages; `notify` reaches the peer after. `source`/`dest`: the local / peer
        buffer seen at the slice's width (pages of staged slices). ValueError when either side
        does not hold all of `heads`, a page or the slot is outside its side's, or a view is
        not of that side's registered buffer."""

    @abstractmethod
    def poll(self) -> Events:
        """Sends finished (or failed, or timed out) since the last poll, and notifications received."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (it died or restarted); its unfinished sends are reported failed."""

    @abstractmethod
    def close(self) -> None:
        """Release every handle and the registration."""
