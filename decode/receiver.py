"""DecodeReceiver: the decode role's part of the scheduler (prealloc and transfer queues).

A request carrying bootstrap_host/port/room goes through

    resolving (allowlist.py: not a configured prefill's address: 400, nothing connects) -->
    bootstrap --handshake ok--> prealloc --pages + slot reserved, KVDest sent--> transfer
        |                          |   (waits while the pool is full, or its prefill |
        |                          |    has as many rooms as first-token slots)      |
        |                          +--> uncached part short: prefill it here          |
        v                               (conditional disaggregation, KVCancel to P)   v
    fail fast (mismatch, dead peer, timeout)          all chunks + first token in: joins the
                                                      running batch as already prefilled

Pages reserved for a transfer are never cached or freed while prefill may still write them:
an abort during transfer sends KVCancel and keeps them until prefill answers KVCancelled
(or is declared dead, or the cancel times out). A request without bootstrap fields is
prefilled here, like colocated. Prefix reuse: the prompt is matched against decode's own
radix cache first and prefill sends only the pages from the first uncached one. What
prefill writes is checked before use: notifications (arrival.py) and the first token. Head
slices it holds more of than a prefill rank arrive in staging pages (decode/staging.py).

A request in a room moves only through the engine's host: `queue_prefill` (prefilled here),
`join_decoding` (its KV arrived) or `retire` (it failed: its reserved pages are discarded, never
cached; or it was cancelled mid-transfer: retired with its pages held until prefill answers,
then `release_held` discards them).

Tensor parallelism: every rank runs this part alike (rank 0's control messages reach the
others in the tick; its clock is `host.now`). Each rank's shard is written by the prefill
ranks head_map pairs it with, each notifying per chunk; a room joins the running batch once
it has fully arrived on every rank (tandem/pd/agree.py).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from tandem.decode.allowlist import Allowlist, Verdict
from tandem.decode.arrival import Arrival
from tandem.decode.incoming import Incoming, Stage
from tandem.decode.peers import PrefillPeers
from tandem.decode.prealloc import reserve_room, room_needed
from tandem.decode.staging import ScatterStaging
from tandem.engine.scheduler.req import FinishReason, KVFate, Req, finish_abort
from tandem.engine.scheduler.role_part import Admission
from tandem.pd import protocol as pd
from tandem.pd.agree import Agreement
from tandem.pd.control.channel import PeerDown, PeerMsg
from tandem.pd.tick_codec import TICK_CODEC
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.protocol.messages import GenerateReq

if TYPE_CHECKING:
    from tandem.engine.scheduler.role_part import Host
    from tandem.engine.scheduler.schedule_batch import ScheduleBatch
    from tandem.pd.transfer.contract import KVTransfer

log = logging.getLogger(__name__)


class DecodeReceiver:
    """The decode role's RolePart (engine/scheduler/role_part.py)."""

    contiguous_pages = True  # arriving KV lands in runs of pages: fewer transfer descriptors
    tick_codec = TICK_CODEC

    def __init__(self, host: Host, transfer: KVTransfer, peers: PrefillPeers, slots: FirstTokenSlots,
                 allow: Allowlist) -> None:
        self.host, self.cfg, self.cache = host, host.config, host.cache
        self.transfer, self.peers, self.slots, self.allow = transfer, peers, slots, allow
        self.arrival = Arrival(peers)
        self.staging = ScatterStaging(self.cache)
        self.agree = Agreement(host.tp)
        self.vocab_size = host.vocab_size
        self.queue: deque[Incoming] = deque()  # resolving + bootstrap + prealloc, in arrival order
        self.rooms: dict[int, Incoming] = {}
        self.by_rid: dict[str, Incoming] = {}
        self.stats = {"transferred": 0, "local_prefills": 0, "reused_tokens": 0, "failed": 0,
                      "handshake_failures": 0, "refused_addresses": 0, "held_for_prefill_slots": 0}
        self.handlers = {PeerMsg: self.on_peer_msg, PeerDown: self.on_peer_down}
        self.on_message = {pd.Welcome: self.on_welcome, pd.KVCancel: self.on_cancel,
                           pd.KVCancelled: self.on_cancelled}
        # The configured peers' handshakes start at the first poll, not here: a peer's age
        # must come from the tick's clock (host.now), or the ranks would time it out apart.

    # ---- requests ---------------------------------------------------------------------------------
    def admit(self, req: Req, msg: GenerateReq) -> Admission | FinishReason:
        if msg.bootstrap_host is None or msg.bootstrap_port is None or msg.bootstrap_room is None:
            return Admission.LOCAL  # no prefill named: prefill here
        if msg.bootstrap_room in self.rooms:
            return finish_abort(f"bootstrap_room {msg.bootstrap_room} is already in use")
        inc = Incoming(req, msg.bootstrap_room, "", self.host.now, Stage.RESOLVING, msg.bootstrap_host,
                       msg.bootstrap_port)
        self.rooms[inc.room], self.by_rid[req.rid] = inc, inc
        self.queue.append(inc)
        self._place([inc])
        return Admission.HELD

    def _place(self, incs: list[Incoming]) -> None:
        """Start the handshake with each request's prefill if decode may talk to it (allowlist.py);
        a PENDING one is placed again at the next poll. Under TP rank 0's verdicts hold on every
        rank (a collective): DNS answers each rank at its own moment."""
        for inc, (verdict, key) in zip(incs, self.allow.agreed([(i.host, i.port) for i in incs], self.host.tp)):
            if verdict is Verdict.REFUSED:
                self.stats["refused_addresses"] += 1
                self._fail(inc, self.allow.refusal(inc.host, inc.port), status=400)
            elif verdict is Verdict.ALLOWED:
                inc.peer, inc.stage = key, Stage.PREALLOC if self.peers.get(key).ready else Stage.BOOTSTRAP

    def abort(self, rid: str) -> bool:
        inc = self.by_rid.get(rid)
        if inc is None:
            return False
        self._cancel(inc, "aborted by client")
        return True

    # ---- control messages ------------------------------------------------------------------------
    def on_peer_msg(self, m: PeerMsg) -> None:
        handler = self.on_message.get(type(m.msg))
        if handler is not None:
            handler(m.peer, m.msg)

    def on_welcome(self, key: str, w: pd.Welcome) -> None:
        error = self.peers.welcome(key, w)
        for inc in [i for i in self.queue if i.peer == key and i.stage == Stage.BOOTSTRAP]:
            if error is not None:
                self.stats["handshake_failures"] += 1
                self._fail(inc, error)
            else:
                inc.stage = Stage.PREALLOC

    def on_cancel(self, key: str, msg: pd.KVCancel) -> None:
        inc = self.rooms.get(msg.room)
        if inc is not None and inc.peer == key:  # prefill writes nothing more there
            self._fail(inc, f"prefill {key} gave up: {msg.reason}")

    def on_cancelled(self, key: str, msg: pd.KVCancelled) -> None:
        inc = self.rooms.get(msg.room)
        if inc is not None and inc.peer == key and inc.stage == Stage.CANCELLING:
            self._fail(inc, "")

    def on_peer_down(self, m: PeerDown) -> None:
        log.error("prefill %s is gone: %s", m.peer, m.reason)
        for inc in [i for i in self.rooms.values() if i.peer == m.peer]:
            self._fail(inc, f"prefill {m.peer} is gone: {m.reason}")
        self.peers.drop(m.peer)

    # ---- the loop's poll ----------------------------------------------------------------------------
    def on_batch_done(self, batch: ScheduleBatch) -> None:
        """Nothing: a transferred request joins the running batch from poll."""

    def on_retire(self, req: Req) -> bool:
        """A request that joined the running batch is the engine's: its KV is released at once.
        One still in a room is ended by this part (retire from _fail or _cancel), except at the
        engine's shutdown: then it ends as a client's abort would, its pages held if prefill may
        still write them."""
        inc = self.by_rid.get(req.rid)
        if inc is None:
            return False
        if inc.stage in (Stage.TRANSFER, Stage.CANCELLING):
            if inc.stage == Stage.TRANSFER:
                self.peers.channel.send(inc.peer, pd.KVCancel(inc.room, "decode is shutting down"))
                inc.stage, inc.since = Stage.CANCELLING, self.host.now
            return True  # _fail releases the pages (discarded) once prefill has let go of them
        if inc in self.queue:
            self.queue.remove(inc)
        self._forget(inc)
        return False

    def poll(self) -> None:
        self.peers.channel.check()  # a dead control thread stops the scheduler: liveness fails
        arrived: list[tuple[str, str]] = []  # rooms whole on this rank
        for agent, note in self.transfer.poll().received:
            got = self.arrival.note(agent, note, self.rooms)
            if got is None or got[0].stage not in (Stage.TRANSFER, Stage.CANCELLING):
                continue
            inc, total = got
            inc.chunks += 1
            inc.total = total if total is not None else inc.total
            writers = self.peers.peers[inc.peer].writers  # Arrival checked the peer is READY
            if inc.stage == Stage.TRANSFER and inc.total is not None and inc.chunks == inc.total * writers:
                arrived.append((str(inc.room), ""))
        # Skipped alike on every rank while no room is in transfer (no collective to agree on).
        if any(i.stage == Stage.TRANSFER for i in self.rooms.values()):
            for room, _ in self.agree.done(arrived):
                inc = self.rooms.get(int(room))  # _forget drops a room's reports: it is still here
                if inc is not None and inc.stage == Stage.TRANSFER:
                    self._complete(inc)
        resolving = [i for i in self.queue if i.stage == Stage.RESOLVING]
        if resolving:
            self._place(resolving)
        self.peers.keep_connected()
        self._preallocate()
        self._expire()

    def _preallocate(self) -> None:
        """First come, first served: a full pool holds everyone behind too. A prefill takes at
        most its first-token slots' worth of rooms (Link.slots, from its Welcome): beyond that
        its rooms wait here, holding no pages, and the others go on."""
        held = Counter(i.peer for i in self.rooms.values() if i.stage in (Stage.TRANSFER, Stage.CANCELLING))
        for inc in list(self.queue):
            if inc.stage != Stage.PREALLOC:
                continue
            full = held[inc.peer] >= self.peers.link(inc.peer).slots
            # Held, a long prompt is not matched against the cache every poll (a match costs its
            # length): one mostly cached here may wait for a slot before it is prefilled here.
            long = len(inc.req.origin_input_ids) > self.cfg.pd_local_prefill_threshold
            if not (full and long) and self._uncached(inc) <= self.cfg.pd_local_prefill_threshold:
                self._prefill_here(inc)
            elif full:
                self.stats["held_for_prefill_slots"] += not inc.held
                inc.held = True
            elif (need := self._room(inc)) is None:
                continue  # it can never fit: failed
            elif self._reserve(inc, need):
                held[inc.peer] += 1
            else:
                break

    def _uncached(self, inc: Incoming) -> int:
        """Match the prompt against decode's radix cache: the tokens prefill would send."""
        req = inc.req
        req.init_next_round_input(self.cache.tree)
        if self.cfg.disable_pd_decode_prefix_reuse:
            empty = self.cache.tree.match_prefix([])
            req.prefix_indices, req.last_node = empty.indices, empty.last_node
            req.extend_input_len = len(req.origin_input_ids)
        return req.extend_input_len

    def _prefill_here(self, inc: Incoming) -> None:
        """Conditional disaggregation: prefill drops the request, decode computes it."""
        self.queue.remove(inc)
        self._forget(inc)
        self.peers.channel.send(inc.peer, pd.KVCancel(inc.room, "decode prefills it (conditional disaggregation)"))
        self.stats["local_prefills"] += 1
        self.host.queue_prefill(inc.req)

    def _room(self, inc: Incoming) -> float | None:
        """The KV tokens `inc`'s room takes, or None: a room larger than the whole pool would wait
        for ever (until pd_prealloc_timeout), so it fails now, retryable on a bigger decode."""
        need, pool = room_needed(self.host, self.staging, self.peers.link(inc.peer).staging, inc), \
            self.host.cache.capacity_tokens()
        if need <= pool:
            return need
        self._fail(inc, f"this request needs {need:.0f} KV tokens on decode, more than its pool holds ({pool})")
        return None

    def _reserve(self, inc: Incoming, need: float) -> bool:
        req = inc.req
        n = len(req.origin_input_ids)
        if not reserve_room(self.host, self.slots, self.staging, self.peers.link(inc.peer).staging, inc, need):
            return False  # the pool is short: wait
        skip = len(req.prefix_indices)
        self.peers.channel.send(inc.peer, pd.KVDest(inc.room, inc.pages, skip, inc.slot, n, inc.staging))
        self.stats["reused_tokens"] += skip
        inc.stage, inc.since = Stage.TRANSFER, self.host.now
        self.queue.remove(inc)
        return True

    def _complete(self, inc: Incoming) -> None:
        """Every chunk landed: the request joins the running batch with its first token."""
        req = inc.req
        if inc.staging:  # the head slices decode staged go into the room's pages
            self.staging.scatter(self.peers.link(inc.peer), inc.staging, inc.pages)
        try:
            token, logprob, top = self.slots.read(inc.slot, self.vocab_size)
        except ValueError as exc:  # not a token of this model: this request fails, nothing else
            self._fail(inc, f"prefill {inc.peer} sent a bad first token: {exc}")
            return
        self._forget(inc)
        self.stats["transferred"] += 1
        self.host.join_decoding(req, token, logprob, top)

    def _expire(self) -> None:
        now, cfg = self.host.now, self.cfg
        for key in self.peers.expired():
            self.peers.drop(key)
            for inc in [i for i in self.queue if i.peer == key and i.stage == Stage.BOOTSTRAP]:
                self._fail(inc, f"no handshake with prefill {key} within {cfg.pd_bootstrap_timeout:.0f} s")
        limits = {Stage.RESOLVING: cfg.pd_bootstrap_timeout, Stage.PREALLOC: cfg.pd_prealloc_timeout,
                  Stage.TRANSFER: cfg.pd_transfer_timeout, Stage.CANCELLING: cfg.pd_transfer_timeout}
        for inc in list(self.rooms.values()):
            limit = limits.get(inc.stage)
            if limit is None or now - inc.since <= limit:
                continue
            if inc.stage == Stage.TRANSFER:
                self._cancel(inc, f"KV did not arrive within {limit:.0f} s")
            else:  # resolving: DNS did not answer; prealloc: the pool stayed full; cancelling: no answer
                self._fail(inc, f"gave up after {limit:.0f} s in {inc.stage}")

    # ---- the end of a room ---------------------------------------------------------------------------
    def _cancel(self, inc: Incoming, why: str) -> None:
        """Stop the request now; pages prefill may still write wait for its KVCancelled."""
        if inc.stage != Stage.TRANSFER:
            self._fail(inc, why)
            if self.peers.peers.get(inc.peer) is not None:
                self.peers.channel.send(inc.peer, pd.KVCancel(inc.room, why))
            return
        self.peers.channel.send(inc.peer, pd.KVCancel(inc.room, why))
        inc.stage, inc.since = Stage.CANCELLING, self.host.now
        self.host.retire(inc.req, finish_abort(why, 503), KVFate.HOLD)

    def _fail(self, inc: Incoming, why: str, status: int = 503) -> None:
        """The room is over: its pages are discarded (never cached: prefill may have written
        them partly) and the request ends with `why` if it runs (a PD fault is 503, retryable
        by a router; a bad request 400), or settles if _cancel ended it already."""
        if inc in self.queue:
            self.queue.remove(inc)
        self._forget(inc)
        if why:
            self.stats["failed"] += 1
        if inc.req.finished():
            self.host.release_held(inc.req, KVFate.DISCARD)
        else:
            self.host.retire(inc.req, finish_abort(why, status), KVFate.DISCARD)

    def _forget(self, inc: Incoming) -> None:
        if inc.slot is not None:
            self.slots.release(inc.slot)
            inc.slot = None
        self.staging.free(inc.staging)
        inc.staging = []
        if self.rooms.get(inc.room) is inc:  # a request refused for reusing a room leaves the room's owner
            del self.rooms[inc.room]
            self.agree.forget(str(inc.room))
        if self.by_rid.get(inc.req.rid) is inc:
            del self.by_rid[inc.req.rid]

    # ---- state ---------------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.rooms)

    def ready(self) -> bool:
        """The control channel runs and a handshake with a configured prefill holds; with none
        configured this worker serves only requests it prefills itself."""
        return self.peers.channel.alive() and (self.peers.any_ready() or not self.peers.configured)

    def status(self) -> dict[str, Any]:
        channel = self.peers.channel
        return {"role": "decode", "ready": self.ready(), "peers": self.peers.status(), "rooms": len(self.rooms),
                "queued": len(self.queue), "handshake_failures": self.peers.handshake_failures,
                "control_alive": channel.alive(), "control_dropped": channel.dropped.count,
                "notes_refused": self.arrival.refused, **self.stats, **self.staging.stats}

    def check_integrity(self) -> None:
        # The idle self-check's language (as the engine's pools): only this process's bugs fail it.
        assert not self.rooms, f"{len(self.rooms)} rooms still open while idle"
        assert not len(self.agree), f"{len(self.agree)} rooms' arrival reports kept while idle"
        self.slots.check_integrity(in_use=0)
