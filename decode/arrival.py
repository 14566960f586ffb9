"""Arrival: which KV notifications a decode rank believes.

NIXL delivers a notification with the name of the agent that wrote it. One counts only
when it parses (pd.parse_notify) and comes from an agent of the prefill its room was
assigned to (under TP, one of the prefill ranks writing into this rank): another prefill,
even an authenticated one, cannot complete (or corrupt the count of) a room it does not
serve. Anything else is dropped and counted, with a rate-limited warning, and the room
goes on waiting (its transfer timeout still holds).
"""

from __future__ import annotations

import logging
import time

from tandem.decode.incoming import Incoming
from tandem.decode.peers import PrefillPeers
from tandem.pd import protocol as pd

log = logging.getLogger(__name__)


class Arrival:
    def __init__(self, peers: PrefillPeers) -> None:
        self.peers = peers
        self.refused = 0
        self._warned_at = -60.0

    def note(self, agent: str, data: bytes, rooms: dict[int, Incoming]) -> tuple[Incoming, int | None] | None:
        """(the room's Incoming, the chunk total if this was the last chunk), or None: a
        notification to ignore (malformed, from the wrong agent, or for a room that ended)."""
        try:
            room, _, total = pd.parse_notify(data)
        except pd.BadMessage as exc:
            self._refuse(agent, str(exc))
            return None
        inc = rooms.get(room)
        if inc is None:
            return None  # a late one for a room that ended
        peer = self.peers.peers.get(inc.peer)
        if peer is None or agent not in peer.agents:
            self._refuse(agent, f"a notification for room {room}, which {inc.peer or 'no prefill'} serves")
            return None
        return inc, total

    def _refuse(self, agent: str, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= 10:
            self._warned_at = now
            log.warning("KV notification from agent %s ignored: %s (%d so far)", str(agent)[:80], why, self.refused)
