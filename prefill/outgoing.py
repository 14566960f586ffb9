"""One request on its way out of a prefill worker (prefill/sender.py), the phases it
passes, and the decode messages that can arrive before it does."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tandem.engine.scheduler.req import Req
from tandem.pd import protocol as pd


class Phase(StrEnum):
    AWAITING_DEST = "awaiting_dest"  # admitted; waits (bounded) for decode's KVDest before it is computed
    AWAITING_SLOT = "awaiting_slot"  # KVDest taken; waits (bounded, in order) for a first-token slot
    SENDING = "sending"  # in the prefill queue: each finished chunk's pages go out
    SENT = "sent"  # the last chunk and the first token are on their way: no more sends
    ENDED = "ended"  # stopped early (abort, cancel, failed send, dead decode): `why` says why


@dataclass(eq=False)
class Outgoing:
    req: Req
    room: int
    since: float
    phase: Phase = Phase.AWAITING_DEST
    why: str = ""  # Phase.ENDED's reason
    dest: pd.KVDest | None = None
    peer: str = ""  # the decode rank that sent dest
    sent_upto: int = 0  # prompt positions whose pages are sent (or that decode had)
    chunks: int = 0
    in_flight: int = 0  # sends not yet reported by NIXL
    slot: int | None = None  # local first-token slot, held from the KVDest taken until settled (slot_queue.py)
    tell: str | None = None  # KVCancel decode with this once settled (nothing in flight)
    cancel_ack: bool = False  # decode asked to cancel: answer KVCancelled once settled

    @property
    def sending(self) -> bool:
        return self.phase is Phase.SENDING


@dataclass(frozen=True)
class Early:
    """A decode message for a room whose request has not arrived yet (the router sends the
    request to both workers at once, so decode's KVDest or KVCancel may win the race)."""

    at: float
    peer: str
    dest: pd.KVDest | None = None  # take it when the request is admitted
    cancel: str | None = None  # KVCancel's reason: end the request when it is admitted
