"""Prefill peers as one decode rank knows them: bootstrap address -> handshake state.

    (absent) --connect + Hello--> CONNECTING --Welcome ok--> READY --PeerDown--> (absent)
                                      |  Welcome refused or no answer in time
                                      v
                                   (absent; the waiting requests fail with the reason)

A peer's key is its bootstrap address "host:port" (allowlist.py: only configured
peers and what they resolve to ever get here). Nothing is sticky: a dead or restarted
prefill is forgotten and the next request to its address handshakes again, so decode
never needs a restart of its own; a configured peer is handshaken again by
keep_connected, at most every RETRY_S.

Tensor parallelism: rank 0 alone connects and sends (the others' channel is a
FollowerChannel); every rank keeps this table alike from the same ticks and the same
clock, and a READY peer's link names the prefill ranks' agents writing into this rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.pd import protocol as pd
from tandem.pd.parts import Link, TransferParts, refused

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a configured peer that failed is handshaken again after this


@dataclass
class Peer:
    key: str
    since: float
    link: Link | None = None  # once READY: its ranks writing into this rank
    name: str = ""  # its instance name (changes when it restarts)

    @property
    def ready(self) -> bool:
        return self.link is not None

    @property
    def agents(self) -> set[str]:
        """The NIXL agents whose notifications this rank believes."""
        return set(self.link.agents.values()) if self.link is not None else set()

    @property
    def writers(self) -> int:
        """Notifications per chunk on this rank: one from each prefill rank writing it."""
        return len(self.link.writes) if self.link is not None else 0


class PrefillPeers:
    def __init__(self, parts: TransferParts, timeout: float, configured: Sequence[str],
                 clock: Callable[[], float]) -> None:
        self.parts, self.channel, self.transfer, self.clock = parts, parts.channel, parts.transfer, clock
        self.hello = pd.Hello(parts.name, **parts.describe())
        self.timeout = timeout
        self.configured = list(configured)
        self.peers: dict[str, Peer] = {}
        self.retry_at: dict[str, float] = {}  # configured peers only
        self.handshake_failures = 0

    def get(self, key: str) -> Peer:
        """The peer at `key` ("host:port", allowed already), starting its handshake if it is new."""
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(key, self.clock())
            self.channel.connect(key, f"tcp://{key}")
            self.channel.send(key, self.hello)
        return peer

    def keep_connected(self) -> None:
        """Configured peers are always being handshaken: readiness depends on them."""
        now = self.clock()
        for key in self.configured:
            if key not in self.peers and now >= self.retry_at.get(key, 0.0):
                self.get(key)

    def welcome(self, key: str, w: pd.Welcome) -> str | None:
        """Finish a handshake; returns the error if it failed (the peer is then dropped)."""
        peer = self.peers.get(key)
        if peer is None or peer.ready:
            return None  # an answer to a handshake we gave up on
        error = w.error if not w.ok else None  # a refusal names the fields only
        if error is None:
            peer.link, problems = self.parts.add_peer(w)
            error = refused(problems, detail=True) if problems else None
        if peer.link is None:
            self.handshake_failures += 1
            log.error("prefill %s: %s", key, error)
            self.drop(key, retry=self.timeout)  # a mismatch holds until one side is redeployed
            return error
        peer.name = w.name
        self.channel.accept(key)
        log.info("handshake with prefill %s (%s)", key, w.name)
        return None

    def expired(self) -> list[str]:
        now = self.clock()
        return [p.key for p in self.peers.values() if not p.ready and now - p.since > self.timeout]

    def drop(self, key: str, retry: float = RETRY_S) -> None:
        if key in self.configured:
            self.retry_at[key] = self.clock() + retry
        peer = self.peers.pop(key, None)
        self.channel.forget(key)
        if peer is not None and peer.link is not None:
            self.parts.drop(peer.link)

    def link(self, key: str) -> Link:
        """A READY peer's link into this rank; an empty one for a peer not (or no longer) ready."""
        peer = self.peers.get(key)
        return peer.link if peer is not None and peer.link is not None else Link(())

    def any_ready(self) -> bool:
        return any(p.ready for p in self.peers.values())

    def status(self) -> dict[str, Any]:
        return {k: {"ready": p.ready, "name": p.name} for k, p in self.peers.items()}

