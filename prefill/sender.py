"""PrefillSender: the prefill role's part of the scheduler (the KV sender and bootstrap server).

A request's life on prefill (one `Outgoing` per bootstrap room):

    admitted --KVDest (checked)--> first-token slot --> waiting queue -> prefill chunks
       |  (bounded: pd_bootstrap_timeout)  (waits in order for one:   |  after each chunk: NIXL
       v                                    slot_queue.py)            v  WRITE of its whole pages
    abort: no decode claimed it               last chunk: the rest + the first-token slot
                                                          |
                        every send reported done ---------+--> KV released (radix keeps it)

The scheduler runs as colocated, with max_new_tokens forced to 1; this part takes the
requests it admits until decode's pages arrive, sends after each prefill batch, and holds
a finished request's KV (RolePart.on_retire answers True) until NIXL reports its sends done.
The request ends through the engine's host (Host.end, retire: its answer goes out then);
every way out of a room (its last send, abort, decode's KVCancel, a failed send, a dead
decode, an end the engine chose) reaches `_settle`, which hands the KV back
(Host.release_held) once no send is in flight and tells decode what happened.

Tensor parallelism: every rank runs this part alike (rank 0's control messages reach the
others in the tick; its clock is `host.now`). A chunk's send is each rank writing its heads
(RankSends), and it counts as reported once every rank has reported its share.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from tandem.engine.scheduler.req import FinishReason, Req, finish_abort
from tandem.engine.scheduler.role_part import Admission
from tandem.pd import protocol as pd
from tandem.pd.agree import Agreement
from tandem.pd.control.channel import PeerDown, PeerMsg
from tandem.pd.parts import Link, TransferParts, refused
from tandem.pd.tick_codec import TICK_CODEC
from tandem.prefill.dest_check import dest_problem
from tandem.prefill.outgoing import Early, Outgoing, Phase
from tandem.prefill.rank_sends import RankSends
from tandem.prefill.slot_queue import SlotQueue
from tandem.prefill.staging import SliceStaging
from tandem.protocol.messages import GenerateReq

if TYPE_CHECKING:
    from tandem.engine.scheduler.role_part import Host
    from tandem.engine.scheduler.schedule_batch import ScheduleBatch

log = logging.getLogger(__name__)

MAX_EARLY = 4096  # decode messages waiting for their request: oldest dropped beyond this


class PrefillSender:
    """The prefill role's RolePart (engine/scheduler/role_part.py)."""

    contiguous_pages = True  # a request's KV leaves in runs of pages: fewer transfer descriptors
    tick_codec = TICK_CODEC

    def __init__(self, host: Host, parts: TransferParts) -> None:
        self.host, self.cfg, self.cache = host, host.config, host.cache
        self.parts = parts
        self.transfer, self.channel, self.layout, self.slots = parts.transfer, parts.channel, parts.layout, parts.slots
        self.peers: dict[str, Link] = {}  # decode name -> the agents of its ranks this rank writes
        self.sends = RankSends(self.transfer, Agreement(host.tp), SliceStaging(self.cache))
        self.rooms: dict[int, Outgoing] = {}
        self.by_rid: dict[str, Outgoing] = {}
        self.early: dict[int, Early] = {}
        self.slot_queue = SlotQueue(self.slots)
        # page_runs (counted by the transfer) / pages_sent: how scattered sends are (a run of consecutive pages on both
        # sides is one descriptor per layer and K/V; docs/pd.md, bandwidth).
        self.stats = {"handshakes": 0, "handshake_failures": 0, "kv_bytes_sent": 0, "sends": 0,
                      "pages_sent": 0, "failed": 0, "bootstrap_timeouts": 0, "slot_timeouts": 0}
        self.handlers = {PeerMsg: self.on_peer_msg, PeerDown: self.on_peer_down}
        self.on_message = {pd.Hello: self.on_hello, pd.KVDest: self.on_dest, pd.KVCancel: self.on_cancel}

    # ---- requests ---------------------------------------------------------------------------------
    def admit(self, req: Req, msg: GenerateReq) -> Admission | FinishReason:
        if msg.bootstrap_room is None:
            return finish_abort("a prefill worker needs bootstrap_room (send requests through a PD router)")
        if msg.bootstrap_room in self.rooms:
            return finish_abort(f"bootstrap_room {msg.bootstrap_room} is already in use")
        req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=1)
        og = Outgoing(req, msg.bootstrap_room, self.host.now)
        self.rooms[og.room], self.by_rid[req.rid] = og, og
        early = self.early.pop(og.room, None)
        if early is not None and early.dest is not None:
            self._take_dest(og, early.peer, early.dest)
        elif early is not None and early.cancel is not None:
            self._end(og, f"cancelled by decode: {early.cancel}", ack=False)
        return Admission.HELD

    def abort(self, rid: str) -> bool:
        og = self.by_rid.get(rid)
        if og is None:
            return False
        self._end(og, "aborted by client")
        return True

    def _take_dest(self, og: Outgoing, peer: str, dest: pd.KVDest) -> None:
        link = self.peers.get(peer)
        og.peer = peer  # told why, if it fails here
        problem = (dest_problem(dest, len(og.req.origin_input_ids), self.layout.page_size, link)
                   if link is not None else "no handshake with this decode")
        if problem is not None:
            self._end(og, f"decode's KVDest does not fit this request ({problem})")
            return
        og.dest, og.sent_upto, og.phase, og.since = dest, dest.skip, Phase.AWAITING_SLOT, self.host.now
        if self.slot_queue.take(og):
            self._start(og)

    def _start(self, og: Outgoing) -> None:
        """`og` holds its first-token slot: it joins the prefill queue."""
        og.phase = Phase.SENDING
        self.host.queue_prefill(og.req)

    # ---- control messages ------------------------------------------------------------------------
    def on_peer_msg(self, m: PeerMsg) -> None:
        handler = self.on_message.get(type(m.msg))
        if handler is None:
            log.warning("unexpected %s from %s", type(m.msg).__name__, m.peer)
            return
        handler(m.peer, m.msg)

    def on_hello(self, peer: str, hello: pd.Hello) -> None:
        link, problems = self.parts.add_peer(hello)
        if link is None:
            self.stats["handshake_failures"] += 1
            log.error("decode %s: %s", peer, refused(problems, detail=True))
            self.channel.send(peer, pd.Welcome(self.parts.name, False, refused(problems, detail=False)))
            return
        self.peers[peer] = link
        self.stats["handshakes"] += 1
        log.info("handshake with decode %s", peer)
        self.channel.accept(peer)
        self.channel.send(peer, pd.Welcome(self.parts.name, True, "", **self.parts.describe()))

    def on_dest(self, peer: str, dest: pd.KVDest) -> None:
        if peer not in self.peers:
            self.channel.send(peer, pd.KVCancel(dest.room, "no handshake with this prefill (it restarted?)"))
            return
        og = self.rooms.get(dest.room)
        if og is None:
            self._keep_early(dest.room, Early(self.host.now, peer, dest=dest))
        elif og.phase is Phase.AWAITING_DEST:
            self._take_dest(og, peer, dest)

    def on_cancel(self, peer: str, msg: pd.KVCancel) -> None:
        og = self.rooms.get(msg.room)
        if peer not in self.peers or (og is not None and og.peer not in ("", peer)):
            return  # only a decode with a handshake cancels, and only its own rooms
        if og is None:  # not here yet, or settled already: either way nothing will be written
            self._keep_early(msg.room, Early(self.host.now, peer, cancel=msg.reason))
            self.channel.send(peer, pd.KVCancelled(msg.room))
            return
        og.cancel_ack = og.peer == peer or not og.peer
        og.peer = og.peer or peer
        self._end(og, f"cancelled by decode: {msg.reason}", ack=False)

    def on_peer_down(self, m: PeerDown) -> None:
        log.error("decode %s is gone: %s", m.peer, m.reason)
        link = self.peers.pop(m.peer, None)
        for og in [og for og in self.rooms.values() if og.peer == m.peer]:
            og.peer = ""  # nobody to tell
            self._end(og, f"decode {m.peer} is gone: {m.reason}")
        if link is not None:
            self.parts.drop(link)  # its unfinished sends come back failed from poll
        self.poll()

    def _keep_early(self, room: int, early: Early) -> None:
        if len(self.early) >= MAX_EARLY:  # bounded: a decode sending for rooms that never come
            del self.early[next(iter(self.early))]
        self.early[room] = early

    # ---- sending -------------------------------------------------------------------------------------
    def on_batch_done(self, batch: ScheduleBatch) -> None:
        """After a prefill batch: send the pages each PD request's chunk completed."""
        for i, req in enumerate(batch.reqs[: batch.num_extend_reqs]):
            og = self.by_rid.get(req.rid)
            if og is None or not og.sending:  # an abort mid-prefill ended the room (on_retire)
                continue
            # This batch's extent, not kv_committed_len: under overlap the next chunk may
            # already be allocated (and its forward still running).
            self._send_chunk(og, batch.prefix_lens[i] + batch.extend_lens[i], last=bool(req.output_ids))

    def _send_chunk(self, og: Outgoing, computed: int, last: bool) -> None:
        P, req, dest = self.layout.page_size, og.req, og.dest
        if dest is None or og.slot is None or req.req_pool_idx is None:
            # Not reachable: SENDING begins with both (_take_dest, _start), a computed chunk has its row.
            self._end(og, "internal: a room sending without its KVDest, slot or row")
            return
        upto = len(req.origin_input_ids) if last else computed // P * P
        if upto <= og.sent_upto and not last:
            return
        row = self.cache.req_to_token[req.req_pool_idx]
        src = (row[og.sent_upto : upto : P] // P).tolist()
        first = (og.sent_upto - dest.skip) // P
        dst = dest.pages[first : first + len(src)]
        slot = None
        if last:  # the slot was reserved with the KVDest (slot_queue.py)
            top = req.top_logprobs[0] if req.top_logprobs else []
            self.slots.write(og.slot, req.output_ids[0], req.logprobs[0] if req.logprobs else None, top)
            slot = (og.slot, dest.slot)
        link = self.peers.get(og.peer)
        if link is None:
            self._end(og, f"KV send refused: no handshake with decode {og.peer}")
            return
        og.chunks += 1
        note = pd.notify(og.room, og.chunks, og.chunks if last else None)
        self.sends.start(f"{og.room}:{og.chunks}", link, src, dst, note, slot, staging=(dest.staging, first))
        og.in_flight += 1
        og.sent_upto = upto
        self.stats["sends"] += 1
        self.stats["pages_sent"] += len(src)
        self.stats["kv_bytes_sent"] += len(src) * self.layout.page_bytes * 2 * self.layout.num_layers
        if last:
            og.phase = Phase.SENT

    def poll(self) -> None:
        self.channel.check()  # a dead control thread stops the scheduler: liveness fails
        # Skipped alike on every rank while nothing is in flight (no collective to agree on).
        reports = self.sends.poll() if any(og.in_flight for og in self.rooms.values()) else []
        for key, error in reports:
            og = self.rooms.get(int(key.split(":")[0]))
            if og is None:
                continue
            og.in_flight -= 1
            if error:
                self.stats["failed"] += 1
                self._end(og, error, override=True)
            self._settle(og)
        for og in self.slot_queue.grant():  # the slots settled rooms freed
            self._start(og)
        now = self.host.now
        for og in list(self.rooms.values()):
            if og.phase is Phase.ENDED:  # the engine ended it (on_retire): settle once nothing is in flight
                self._settle(og)
                continue
            if og.phase is Phase.AWAITING_SLOT and now - og.since > self.cfg.pd_transfer_timeout:
                self.stats["slot_timeouts"] += 1  # decode gives up on the transfer then too
                self._end(og, f"no first-token slot free within {self.cfg.pd_transfer_timeout:.0f} s")
            if og.phase is Phase.AWAITING_DEST and now - og.since > self.cfg.pd_bootstrap_timeout:
                self.stats["bootstrap_timeouts"] += 1
                # 408, not 503: this prefill is sound, the request's other half never came (a decode
                # that died first answers its own client; a client posting here alone gets a 4xx).
                self._end(og, f"no decode claimed this request within {self.cfg.pd_bootstrap_timeout:.0f} s",
                          status=408)
        for room, early in list(self.early.items()):
            if now - early.at > 2 * self.cfg.pd_bootstrap_timeout:
                del self.early[room]

    # ---- the end of a room ---------------------------------------------------------------------------
    def _end(self, og: Outgoing, why: str, ack: bool = True, override: bool = False, status: int = 503) -> None:
        """No more sends for this room: end the request where it is (now, or at its next result
        if a prefill batch holds it), then settle. `ack` False: decode asked for it (its client
        aborted, or it prefills the request itself): not an error of this request, so its HTTP
        answer is a 200 with finish_reason abort."""
        if og.phase in (Phase.SENT, Phase.ENDED) and not override:
            self._settle(og)
            return
        self._stop(og, why, tell=ack)
        self.host.end(og.req, finish_abort(why, status if ack else 200))  # on_retire: held until settled
        self._settle(og)

    def _stop(self, og: Outgoing, why: str, tell: bool) -> None:
        if og.phase is Phase.AWAITING_SLOT:
            self.slot_queue.leave(og)
        og.phase, og.why = Phase.ENDED, why
        if tell:
            og.tell = why

    def on_retire(self, req: Req) -> bool:
        """A PD request's KV stays until its sends are reported (then _settle hands it back).
        An abort the engine chose (a failed batch, a timeout, a grammar over budget) also
        ends the room, and decode is told."""
        og = self.by_rid.get(req.rid)
        if og is None:
            return False
        reason = req.finished_reason
        if og.phase not in (Phase.SENT, Phase.ENDED) and reason is not None and reason.kind == "abort":
            self._stop(og, reason.message, tell=True)
        return True

    def _settle(self, og: Outgoing) -> None:
        """Release the room once its request is finished, no more sends will start and
        every started one has been reported. Once: a failed send's report ends the room
        (_end settles) and is settled again by poll, which once freed its slot twice."""
        if self.rooms.get(og.room) is not og or not (og.req.finished() and og.in_flight == 0 and not og.sending):
            return
        if og.slot is not None:
            self.slots.release(og.slot)
            og.slot = None
        if og.peer and og.tell is not None:  # decode may free its pages now
            self.channel.send(og.peer, pd.KVCancel(og.room, og.tell))
        elif og.peer and og.cancel_ack:
            self.channel.send(og.peer, pd.KVCancelled(og.room))
        del self.rooms[og.room], self.by_rid[og.req.rid]
        self.host.release_held(og.req)

    # ---- state ---------------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.rooms)

    def status(self) -> dict[str, Any]:
        return {"role": "prefill", "name": self.transfer.name, "decode_peers": sorted(self.peers),
                "rooms": len(self.rooms), "slot_queue": len(self.slot_queue.waiting),
                "slot_waits": self.slot_queue.waited, "page_runs": self.transfer.runs_sent,
                "control_alive": self.channel.alive(), "control_dropped": self.channel.dropped.count,
                **self.stats, **self.sends.status()}

    def check_integrity(self) -> None:
        # The idle self-check's own language (engine/scheduler/cache_manager.py): what it reports
        # is a bug of this process, never a peer's input.
        assert not self.rooms and not self.slot_queue.waiting, f"{len(self.rooms)} rooms still open while idle"
        self.sends.check_integrity()
        self.slots.check_integrity(in_use=0)
