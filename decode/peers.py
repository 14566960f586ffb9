"""Prefill peers as one decode rank knows them: bootstrap address -> handshake state.

    (absent) --connect + Hello--> CONNECTING --Welcome ok--> READY --PeerDown--> (absent)
                                      |  Welcome refused or no answer in time
                                      v
                                   (absent; the waiting requests fail with the reason)

A peer's key is its bootstrap address "host:port", which is what requests carry.
Nothing is sticky: a dead or restarted prefill is forgotten and the next request to
its address handshakes again, so decode never needs a restart of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from tandem.engine.transfer.setup import TransferParts
from tandem.protocol import pd

log = logging.getLogger(__name__)


@dataclass
class Peer:
    key: str
    since: float
    agent: str | None = None  # its NIXL agent name once READY
    name: str = ""  # its instance name (changes when it restarts)

    @property
    def ready(self) -> bool:
        return self.agent is not None


class PrefillPeers:
    def __init__(self, parts: TransferParts, timeout: float) -> None:
        self.parts, self.channel, self.transfer = parts, parts.channel, parts.transfer
        self.hello = pd.Hello(parts.name, **parts.describe())
        self.timeout = timeout
        self.peers: dict[str, Peer] = {}
        self.handshake_failures = 0

    def get(self, key: str) -> Peer:
        """The peer at `key`, starting its handshake if it is new."""
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(key, time.monotonic())
            self.channel.connect(key, f"tcp://{key}")
            self.channel.send(key, self.hello)
        return peer

    def welcome(self, key: str, w: pd.Welcome) -> str | None:
        """Finish a handshake; returns the error if it failed (the peer is then dropped)."""
        peer = self.peers.get(key)
        if peer is None or peer.ready:
            return None  # an answer to a handshake we gave up on
        error = w.error if not w.ok else None
        if error is None:
            peer.agent, error = self.parts.add_peer(w)
        if peer.agent is None:
            self.handshake_failures += 1
            log.error("prefill %s: %s", key, error)
            self.drop(key)
            return error
        peer.name = w.name
        self.channel.accept(key)
        log.info("handshake with prefill %s (%s)", key, w.name)
        return None

    def expired(self) -> list[str]:
        now = time.monotonic()
        return [p.key for p in self.peers.values() if not p.ready and now - p.since > self.timeout]

    def drop(self, key: str) -> None:
        peer = self.peers.pop(key, None)
        self.channel.forget(key)
        if peer is not None and peer.agent is not None:
            self.transfer.remove_peer(peer.agent)

    def any_ready(self) -> bool:
        return any(p.ready for p in self.peers.values())

    def status(self) -> dict[str, Any]:
        return {k: {"ready": p.ready, "name": p.name} for k, p in self.peers.items()}

