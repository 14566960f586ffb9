"""The tick: what rank 0 of a tensor-parallel group hands every rank each loop iteration.

Every rank runs the same scheduler over the same model shard; they stay in step only if every
input that can steer a decision is the same on all of them. Rank 0 alone reads the front's
socket, and everything it knows that the others cannot goes out in one broadcast per iteration:

    msgs      the messages it received (requests, aborts, admin commands, shutdown)
    now       its clock, which timeouts and arrival times use on every rank
    grammar   which queued grammars it found compiled (or failed, why, and its status): a
              compile finishes at a different moment on each rank, so rank 0 decides
    over_budget  which running requests' matchers went over their CPU budget: each rank
              measures its own CPU time, so rank 0's measure decides

Every rank applies them after the tick's messages: a verdict for a request that one of those
messages aborted is dropped, on every rank alike.

Encoded as versioned JSON, never pickled (group.py says why): the front's messages by
tandem.protocol.messages, a PD role's own inbox messages (control frames, a dead peer) by the
`TickCodec` its part brings (RolePart.tick_codec), so the engine imports nothing of the roles.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.engine.parallel.group import TPGroup
from tandem.protocol.messages import decode, encode

TICK_VERSION = 3  # 2: a role part's messages, {"part": ...}; 3: a verdict's status, over_budget
GrammarVerdict = tuple[str, str | None, int]  # (rid, None: compiled | the reason it failed, status)
BudgetVerdict = tuple[str, str]  # (rid, why its grammar costs too much)


class TickCodec(Protocol):
    """A role part's inbox messages as JSON values (tandem/pd/tick_codec.py)."""

    def encode(self, msg: Any) -> Any | None:
        """`msg` as a JSON value, or None: not one of the part's messages."""

    def decode(self, obj: Any) -> Any:
        """What encode gave, as the message again."""


def _encode_msg(msg: Any, codec: TickCodec | None) -> Any:
    part = codec.encode(msg) if codec is not None else None
    return encode(msg).decode() if part is None else {"part": part}


def _decode_msg(obj: Any, codec: TickCodec | None) -> Any:
    if isinstance(obj, str):
        return decode(obj.encode())
    # invariant: rank 0 encodes a part's message only with its codec
    assert codec is not None, "a role part's message in a tick without the part's codec"
    return codec.decode(obj["part"])


@dataclass
class Tick:
    now: float
    msgs: list[Any] = field(default_factory=list)
    grammar: list[GrammarVerdict] = field(default_factory=list)
    over_budget: list[BudgetVerdict] = field(default_factory=list)

    def encode(self, codec: TickCodec | None = None) -> bytes:
        return json.dumps({"v": TICK_VERSION, "now": self.now, "grammar": self.grammar,
                           "over_budget": self.over_budget,
                           "msgs": [_encode_msg(m, codec) for m in self.msgs]}).encode()

    @classmethod
    def decode(cls, data: bytes, codec: TickCodec | None = None) -> Tick:
        obj = json.loads(data)
        if obj.get("v") != TICK_VERSION:
            raise ValueError(f"tick version {obj.get('v')} != {TICK_VERSION}")
        return cls(float(obj["now"]), [_decode_msg(m, codec) for m in obj["msgs"]],
                   [(str(rid), why, int(status)) for rid, why, status in obj["grammar"]],
                   [(str(rid), str(why)) for rid, why in obj["over_budget"]])


def exchange(tp: TPGroup, msgs: list[Any] | None,
             grammar: tuple[list[GrammarVerdict], list[BudgetVerdict]] | None,
             codec: TickCodec | None = None) -> Tick:
    """Rank 0 passes what it received and decided; every rank gets the same Tick back."""
    if tp.leader:
        verdicts, over_budget = grammar or ([], [])
        tick = Tick(time.monotonic(), list(msgs or []), list(verdicts), list(over_budget))
        tp.broadcast_bytes(tick.encode(codec))
        return tick
    return Tick.decode(tp.broadcast_bytes(None), codec)
