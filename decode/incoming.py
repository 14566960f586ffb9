"""One request on its way into a decode worker, and the stages it passes (decode/receiver.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from tandem.engine.scheduler.req import Req


class Stage(StrEnum):
    RESOLVING = "resolving"  # its prefill's address is being checked against the allowlist
    BOOTSTRAP = "bootstrap"  # waiting for the handshake with its prefill
    PREALLOC = "prealloc"  # waiting for free pages, a first-token slot, and room at its prefill (Link.slots)
    TRANSFER = "transfer"  # pages reserved and KVDest sent: prefill is writing them
    CANCELLING = "cancelling"  # cancelled mid-transfer: its pages wait for prefill's KVCancelled


@dataclass(eq=False)
class Incoming:
    req: Req
    room: int
    peer: str  # its prefill's key, "" while resolving
    since: float  # when it entered its stage: each stage has its own timeout
    stage: Stage = Stage.BOOTSTRAP
    host: str = ""  # bootstrap_host:bootstrap_port as the request gave them
    port: int = 0
    slot: int | None = None
    chunks: int = 0
    total: int | None = None
    held: bool = False  # waited in prealloc for its prefill's first-token slots
    pages: list[int] = field(default_factory=list)  # the pages KVDest named (reserved for the transfer)
    staging: list[list[int]] = field(default_factory=list)  # KVDest.staging: pool pages (decode/staging.py)
