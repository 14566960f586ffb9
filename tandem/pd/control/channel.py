"""ControlChannel: the PD control messages of one scheduler process, over ZMQ, with heartbeats.

    scheduler thread --send/connect/accept--> command queue --wake--> io thread --zmq--> peers
    scheduler inbox  <--PeerMsg / PeerDown-------------------------- io thread <--zmq-- peers

Prefill binds one ROUTER on its bootstrap port; each decode rank connects one DEALER
per prefill it talks to (its identity is its agent name). The io thread owns every
socket (ZMQ sockets are single-threaded) and answers heartbeats itself, so a long
forward on the scheduler thread never looks like a dead peer.

Liveness: a peer is `known` once the scheduler accepted its handshake. Decode sends
Heartbeat to known prefills every `interval`; prefill answers HeartbeatAck(known=...).
Any message counts as a sign of life. A known peer silent for `timeout`, or a prefill
answering known=False (it restarted and lost the handshake), becomes PeerDown in the
inbox, once, and is forgotten: the next request to it handshakes again.

Hostile input (the bootstrap port is reachable from the network): frames are bounded,
counted and checked (frames.py, pd.decode), bad ones dropped; a failing command
fails its peer, not the thread; per-peer state exists only for peers the scheduler
connected or accepted; with a PD secret, CURVE (auth.py). Should the io thread die
anyway, `check()` raises ChannelDead on the scheduler thread, so the worker fails its
liveness probe instead of staying Ready but deaf.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from tandem.pd import protocol as pd
from tandem.pd.control.auth import CurveKeys, ZapHandler
from tandem.pd.control.frames import Dropped, bounded_socket, peer_ident, peer_name, recv_frames

log = logging.getLogger(__name__)

MAX_BATCH = 256  # messages read from one socket per pass: a flood cannot starve the heartbeats
MAX_FAILED_PASSES = 20  # consecutive io passes failing unexpectedly: the thread gives up (ChannelDead)


@dataclass
class PeerMsg:
    peer: str
    msg: Any


@dataclass
class PeerDown:
    peer: str
    reason: str


class ChannelDead(RuntimeError):
    """The control channel's io thread is gone: no handshake or heartbeat works any more."""


class ControlChannel:
    def __init__(self, name: str, inbox: Any, interval: float = 2.0, timeout: float = 10.0,
                 secret: str | None = None) -> None:
        self.name, self.inbox = name, inbox
        self.interval, self.timeout = interval, timeout
        self.keys = CurveKeys.from_secret(secret) if secret else None
        if self.keys is None:
            log.warning("PD control channel of %s is unauthenticated: any host that reaches it can take part "
                        "(set TANDEM_PD_SECRET on every prefill and decode worker)", name)
        self.ctx = zmq.Context()
        self.router: zmq.Socket | None = None
        self.zap: ZapHandler | None = None
        self.dealers: dict[str, zmq.Socket] = {}
        self.known: set[str] = set()
        self.last_seen: dict[str, float] = {}  # known peers and connected dealers only
        self.dropped = Dropped()  # frames and messages refused
        self.crashed: BaseException | None = None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        wake_addr = f"inproc://wake-{uuid.uuid4().hex}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._run, name="tandem-pd-control", daemon=True)

    # ---- scheduler side (thread-safe: commands for the io thread) ------------------------------
    def bind(self, endpoint: str) -> None:
        """Prefill: listen on `endpoint` (before start: a taken port fails the start-up)."""
        self.router = bounded_socket(self.ctx, zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, never blocks
        if self.keys is not None:
            self.zap = ZapHandler(self.ctx, self.keys)
            self.keys.server(self.router)
        self.router.bind(endpoint)

    def start(self) -> None:
        self.thread.start()

    def connect(self, peer: str, endpoint: str) -> None:
        self._command(("connect", peer, endpoint))

    def send(self, peer: str, msg: Any) -> None:
        self._command(("send", peer, msg))

    def accept(self, peer: str) -> None:
        """The handshake with `peer` succeeded: watch its liveness from now on."""
        self._command(("accept", peer, None))

    def forget(self, peer: str) -> None:
        self._command(("forget", peer, None))

    def alive(self) -> bool:
        return self.running and self.crashed is None and self.thread.is_alive()

    def check(self) -> None:
        """Raise ChannelDead on the caller's (the scheduler's) thread once the io thread is gone."""
        if self.thread.ident is not None and not self.alive():
            raise ChannelDead(f"the PD control channel stopped: {self.crashed!r}")

    def close(self) -> None:
        self.running = False
        self._command(("stop", "", None))
        self.thread.join(timeout=5)

    def _command(self, cmd: tuple[str, str, Any]) -> None:
        self.commands.put(cmd)
        with self._wake_lock:
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # wake-ups pending already: the io thread drains every command
                pass

    # ---- io thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        self.poller = zmq.Poller()  # the io thread's: sockets join and leave it as they come and go
        for s in (self._wake_rx, self.router, self.zap.sock if self.zap else None):
            if s is not None:
                self.poller.register(s, zmq.POLLIN)
        self._next_beat, failed = time.monotonic(), 0
        try:
            while self.running:
                try:
                    self._pass()
                    failed = 0
                except Exception:  # not a peer's doing (those are handled where they arise)
                    failed += 1
                    log.exception("PD control channel: io pass failed (%d in a row)", failed)
                    if failed >= MAX_FAILED_PASSES:
                        raise
        except BaseException as exc:
            self.crashed = exc
            log.critical("PD control channel stopped: %r", exc)
        finally:
            self._shutdown()

    def _pass(self) -> None:
        events = dict(self.poller.poll(timeout=int(self.interval * 500)))
        if self._wake_rx in events:
            while self._wake_rx.poll(0):
                self._wake_rx.recv()
            self._run_commands()
        if self.zap is not None and self.zap.sock in events:
            self.zap.handle()
        if self.router is not None and self.router in events:
            self._read(self.router, None)
        for peer, s in list(self.dealers.items()):
            if s in events:
                self._read(s, peer)
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + self.interval
            self._beat(now)

    def _shutdown(self) -> None:
        self.running = False
        with self._wake_lock:
            for s in [self.router, *self.dealers.values(), self._wake_rx, self._wake_tx]:
                if s is not None:
                    s.close(linger=0)
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()

    def _run_commands(self) -> None:
        while True:
            try:
                kind, peer, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._do(kind, peer, arg)
            except zmq.ZMQError as exc:  # this peer fails, not the channel
                log.error("PD control: %s %s failed: %s", kind, peer, exc)
                if kind == "connect" or peer in self.known:
                    self._down(peer, f"control channel {kind} failed: {exc}")

    def _do(self, kind: str, peer: str, arg: Any) -> None:
        if kind == "connect":
            self._drop_dealer(peer)
            s = bounded_socket(self.ctx, zmq.DEALER)
            try:
                s.setsockopt(zmq.IDENTITY, self.name.encode())
                s.setsockopt(zmq.IPV6, 1)  # "[v6 address]:port" endpoints; IPv4 ones work as before
                if self.keys is not None:
                    self.keys.client(s)
                s.connect(arg)
            except zmq.ZMQError:
                s.close(linger=0)
                raise
            self.dealers[peer] = s
            self.poller.register(s, zmq.POLLIN)
            self.last_seen[peer] = time.monotonic()
        elif kind == "send":
            self._send(peer, arg)
        elif kind == "accept":
            self.known.add(peer)
            self.last_seen[peer] = time.monotonic()
        elif kind == "forget":
            self.known.discard(peer)
            self._drop_dealer(peer)
        elif kind == "stop":
            self.running = False

    def _drop_dealer(self, peer: str) -> None:
        s = self.dealers.pop(peer, None)
        if peer not in self.known:
            self.last_seen.pop(peer, None)
        if s is not None:
            self.poller.unregister(s)
            s.close(linger=0)

    def _send(self, peer: str, msg: Any) -> None:
        data = pd.encode(msg)
        try:
            if peer in self.dealers:
                self.dealers[peer].send(data, zmq.NOBLOCK)
            elif self.router is not None:
                self.router.send_multipart([peer_ident(peer), data], zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:  # unreachable peer: its heartbeat timeout reports it
            log.warning("control message to %s not sent: %s", peer, exc)

    def _read(self, sock: zmq.Socket, dealer: str | None) -> None:
        """Up to MAX_BATCH messages waiting on `sock`: [identity, data] on the ROUTER, [data]
        on a dealer. A message of any other shape is dropped whole."""
        want = 2 if dealer is None else 1
        for _ in range(MAX_BATCH):
            if dealer is not None and self.dealers.get(dealer) is not sock:
                return  # dropped while reading (its peer went down)
            got = recv_frames(sock, want)
            if got is None:
                return
            frames, count = got
            peer = dealer if dealer is not None else peer_name(frames[0])
            if count != want:
                self.dropped(peer, f"{count} frames, {want} expected")
            else:
                self._received(peer, frames[-1])

    def _received(self, peer: str, data: bytes) -> None:
        try:
            msg = pd.decode(data)
        except pd.BadMessage as exc:
            self.dropped(peer, str(exc))
            return
        if peer in self.known or peer in self.dealers:
            self.last_seen[peer] = time.monotonic()
        if isinstance(msg, pd.Heartbeat):
            self._send(peer, pd.HeartbeatAck(self.name, peer in self.known))
        elif isinstance(msg, pd.HeartbeatAck):
            if not msg.known and peer in self.known:
                self._down(peer, f"prefill {msg.name} no longer knows this decode (it restarted)")
        else:
            self.inbox.put(PeerMsg(peer, msg))

    def _beat(self, now: float) -> None:
        for peer in list(self.known):
            if now - self.last_seen.get(peer, now) > self.timeout:
                self._down(peer, f"no heartbeat for {self.timeout:.0f} s")
            elif peer in self.dealers:
                self._send(peer, pd.Heartbeat(self.name))

    def _down(self, peer: str, reason: str) -> None:
        self.known.discard(peer)
        self._drop_dealer(peer)
        self.inbox.put(PeerDown(peer, reason))
