"""The tick: what rank 0 of a tensor-parallel group hands every rank each loop iteration.

Every rank runs the same scheduler over the same model shard; they stay in step only if every
input that can steer a decision is the same on all of them. Rank 0 alone reads the front's
socket, and everything it knows that the others cannot goes out in one broadcast per iteration:

    msgs      the messages it received (requests, aborts, admin commands, shutdown)
    now       its clock, which timeouts and arrival times use on every rank
    grammar   which queued grammars it found compiled (or failed, and why): the compile
              thread finishes at a different moment on each rank, so rank 0 decides

Encoded as versioned JSON by tandem.protocol.messages, never pickled (group.py says why).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.parallel.group import TPGroup
from tandem.protocol.messages import decode, encode

TICK_VERSION = 1
GrammarVerdict = tuple[str, str | None]  # (rid, None: compiled | the reason it failed)


@dataclass
class Tick:
    now: float
    msgs: list[Any] = field(default_factory=list)
    grammar: list[GrammarVerdict] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps({"v": TICK_VERSION, "now": self.now, "grammar": self.grammar,
                           "msgs": [encode(m).decode() for m in self.msgs]}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Tick:
        obj = json.loads(data)
        if obj.get("v") != TICK_VERSION:
            raise ValueError(f"tick version {obj.get('v')} != {TICK_VERSION}")
        return cls(float(obj["now"]), [decode(m.encode()) for m in obj["msgs"]],
                   [(str(rid), why) for rid, why in obj["grammar"]])


def exchange(tp: TPGroup, msgs: list[Any] | None, grammar: list[GrammarVerdict] | None) -> Tick:
    """Rank 0 passes what it received and decided; every rank gets the same Tick back."""
    if tp.leader:
        tick = Tick(time.monotonic(), list(msgs or []), list(grammar or []))
        if tp.size == 1:
            return tick
        tp.broadcast_bytes(tick.encode())
        return tick
    return Tick.decode(tp.broadcast_bytes(None))
