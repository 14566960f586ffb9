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

from tandem.protocol import pd

log = logging.getLogger(__name__)


@dataclass
class PeerMsg:
    peer: str
    msg: Any


@dataclass
class PeerDown:
    peer: str
    reason: str


class ControlChannel:
    def __init__(self, name: str, inbox: Any, interval: float = 2.0, timeout: float = 10.0) -> None:
        self.name, self.inbox = name, inbox
        self.interval, self.timeout = interval, timeout
        self.ctx = zmq.Context()
        self.router: zmq.Socket | None = None
        self.dealers: dict[str, zmq.Socket] = {}
        self.known: set[str] = set()
        self.last_seen: dict[str, float] = {}
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
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, never blocks
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

    def close(self) -> None:
        self.running = False
        self._command(("stop", "", None))
        self.thread.join(timeout=5)

    def _command(self, cmd: tuple[str, str, Any]) -> None:
        self.commands.put(cmd)
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)

    # ---- io thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = time.monotonic()
        self.poller = zmq.Poller()  # the io thread's: sockets join and leave it as they come and go
        self.poller.register(self._wake_rx, zmq.POLLIN)
        if self.router is not None:
            self.poller.register(self.router, zmq.POLLIN)
        try:
            while self.running:
                events = dict(self.poller.poll(timeout=int(self.interval * 500)))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                    self._run_commands()
                if self.router is not None and self.router in events:
                    while self.router.poll(0):
                        ident, data = self.router.recv_multipart()
                        self._received(ident.decode(), data)
                for peer, s in list(self.dealers.items()):
                    while s in events and s.poll(0):
                        self._received(peer, s.recv())
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.interval
                    self._beat(now)
        finally:
            for s in [self.router, *self.dealers.values(), self._wake_rx, self._wake_tx]:
                if s is not None:
                    s.close(linger=0)
            self.ctx.term()

    def _run_commands(self) -> None:
        while True:
            try:
                kind, peer, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "connect":
                self._drop_dealer(peer)
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IDENTITY, self.name.encode())
                s.connect(arg)
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
        if s is not None:
            self.poller.unregister(s)
            s.close(linger=0)

    def _send(self, peer: str, msg: Any) -> None:
        data = pd.encode(msg)
        try:
            if peer in self.dealers:
                self.dealers[peer].send(data, zmq.NOBLOCK)
            elif self.router is not None:
                self.router.send_multipart([peer.encode(), data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unreachable peer: its heartbeat timeout reports it
            log.warning("control message to %s not sent: %s", peer, exc)

    def _received(self, peer: str, data: bytes) -> None:
        self.last_seen[peer] = time.monotonic()
        try:
            msg = pd.decode(data)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad control message from %s: %s", peer, exc)
            return
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
