"""The prefill/decode control protocol: messages between a decode rank and a prefill
rank, torch-free and versioned (docs/pd.md has the sequence diagram).

    decode                                     prefill (ROUTER on its bootstrap port)
    Hello(identity, layout, agent, meta) --->  checks compatibility
                                        <---   Welcome(ok | error, its identity, layout, agent, meta)
    KVDest(room, dst pages, skip, slot) --->   request waits for this before it is computed
                                        <---   NIXL WRITEs per chunk, notify "room:chunk:total|-"
    KVCancel(room, reason)              <-->   either side gives up a room (abort, failure, local prefill)
                                        <---   KVCancelled(room): prefill writes nothing more there
    Heartbeat                           <-->   HeartbeatAck(instance): a new instance = a restart

KV bytes never travel here: NIXL moves them (engine/transfer/). `bootstrap_room` (an
int chosen by the router) names a request on both sides; these messages carry it as `room`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PD_VERSION = 1


@dataclass(frozen=True)
class Identity:
    """What two workers must agree on to exchange KV pages."""

    version: int
    model_id: str  # hash of the model's config and weight index (engine/transfer/identity.py)
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def mismatch(self, other: Identity) -> list[str]:
        return [f"{k}: {a!r} != {b!r}" for k, a, b in
                ((k, getattr(self, k), getattr(other, k)) for k in self.__dataclass_fields__) if a != b]


@dataclass(frozen=True)
class MetaRegion:
    """A worker's registered first-token slots: `slots` rows of `slot_bytes` at `addr`."""

    addr: int
    slot_bytes: int
    slots: int


@dataclass
class Hello:
    name: str  # the decode rank's transfer agent (also its ZMQ identity)
    identity: dict[str, Any]
    layout: dict[str, Any]
    agent: str  # NIXL agent metadata, base64
    meta: dict[str, Any]


@dataclass
class Welcome:
    name: str  # the prefill rank's agent; a new name means a new process
    ok: bool
    error: str = ""
    identity: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    agent: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class KVDest:
    """Decode reserved pages for `room`: prefill writes positions [skip, prompt_len) of the
    prompt's KV into `pages` (page i holds positions skip + i*page_size ...), then the first
    token into meta slot `slot`."""

    room: int
    pages: list[int]
    skip: int
    slot: int
    prompt_len: int


@dataclass
class KVCancel:
    room: int
    reason: str


@dataclass
class KVCancelled:
    room: int


@dataclass
class Heartbeat:
    name: str


@dataclass
class HeartbeatAck:
    name: str
    known: bool  # False: this prefill has no handshake with the sender (it restarted)


PD_TYPES = {t.__name__: t for t in (Hello, Welcome, KVDest, KVCancel, KVCancelled, Heartbeat, HeartbeatAck)}


def encode(msg: Any) -> bytes:
    return json.dumps({"v": PD_VERSION, "type": type(msg).__name__, "body": asdict(msg)},
                      separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    obj = json.loads(data)
    if obj.get("v") != PD_VERSION:
        raise ValueError(f"PD protocol version {obj.get('v')} != {PD_VERSION}")
    return PD_TYPES[obj["type"]](**obj["body"])


def notify(room: int, chunk: int, total: int | None) -> bytes:
    """NIXL notification after a chunk's WRITEs: total is set on the last one only."""
    return f"{room}:{chunk}:{'-' if total is None else total}".encode()


def parse_notify(data: bytes) -> tuple[int, int, int | None]:
    room, chunk, total = data.decode().split(":")
    return int(room), int(chunk), None if total == "-" else int(total)
