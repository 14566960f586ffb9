"""The prefill/decode control protocol: messages between a decode rank and a prefill
rank, torch-free and versioned (docs/pd.md has the sequence diagram).

    decode                                     prefill (ROUTER on its bootstrap port)
    Hello(identity, layout, agent, meta, ranks) --->  checks compatibility
                                        <---   Welcome(ok | error, its identity, layout, agent, meta, ranks)
    KVDest(room, dst pages, skip, slot,
           staging)                     --->   request waits for this before it is computed
                                        <---   NIXL WRITEs per chunk, notify "room:chunk:total|-"
    KVCancel(room, reason)              <-->   either side gives up a room (abort, failure, local prefill)
                                        <---   KVCancelled(room): prefill writes nothing more there
    Heartbeat                           <-->   HeartbeatAck(instance): a new instance = a restart

KV bytes never travel here: NIXL moves them (tandem/pd/transfer/). `bootstrap_room` (an
int chosen by the router) names a request on both sides; these messages carry it as `room`.

Nothing a peer sends is trusted: `decode` checks every field against its schema
(schema.py: exact keys, types, bounds) and returns a well-typed message or raises
BadMessage, the one exception a receiver has to catch; `parse_notify` likewise.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.pd.schema import BadMessage as BadMessage
from tandem.pd.schema import Spec, boolean, int_list, list_of, one_of, record, text, uint, where

# 2: the layout says where the KV lives (mem_type, device_id)
# 3: the layout holds a range of the model's KV heads (tensor parallelism: head_start,
#    total_kv_heads), and the identity's num_kv_heads is the model's, not one rank's
# 4: Hello and Welcome carry every TP rank's half (`ranks`): each rank is its own NIXL agent
# 5: KVDest carries the staging pages decode reserved for head slices it scatters (`staging`)
# 6: the identity says whether the worker runs deterministic mode (`deterministic`)
# 7: the identity carries the fp8 KV cache's scales (`kv_scales`: "unit" or their digest)
PD_VERSION = 7
MAX_MESSAGE_BYTES = 1 << 20  # also the ZMQ sockets' MAXMSGSIZE: a bigger frame drops its sender


@dataclass(frozen=True)
class Identity:
    """What two workers must agree on to exchange KV pages."""

    version: int
    model_id: str  # hash of the model's config and weight index (tandem/pd/identity.py)
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int  # the model's (all TP ranks together): a rank's share is in its KVLayout
    head_dim: int
    # Deterministic mode on both roles, or on neither: under a default-mode decode a deterministic
    # prefill's request would lose its guarantee after the first token, silently.
    deterministic: bool = False
    # An fp8 pool's per-layer K/V scales (engine/kvcache/kv_scales.py): "unit" (all 1.0) or a digest.
    # Pages stored under one scale and read under another are wrong by their ratio, silently.
    kv_scales: str = "unit"

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
    # TP ranks 1.. of the sender, each {layout, agent, meta} (the fields above are rank 0's;
    # the identity is every rank's): tandem/pd/transfer/head_map.py pairs the ranks.
    ranks: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Welcome:
    name: str  # the prefill rank's agent; a new name means a new process
    ok: bool
    error: str = ""
    identity: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    agent: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # as Hello's

    def __post_init__(self) -> None:
        self.error = self.error[:MAX_TEXT]  # the schema's bound: a longer one would be refused


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
    # Between TP sizes where decode holds more heads than a prefill rank: per such write of a
    # decode rank (head_map.Write.scatter), pool pages prefill writes the slice into as whole
    # pages (head_map.Staging); empty: the slices go where they lie.
    staging: list[list[int]] = field(default_factory=list)


@dataclass
class KVCancel:
    room: int
    reason: str

    def __post_init__(self) -> None:
        self.reason = self.reason[:MAX_TEXT]


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


Message = Hello | Welcome | KVDest | KVCancel | KVCancelled | Heartbeat | HeartbeatAck
PD_TYPES = {t.__name__: t for t in (Hello, Welcome, KVDest, KVCancel, KVCancelled, Heartbeat, HeartbeatAck)}

# ---- the schema: every field's type and bounds -----------------------------------------------------
ROOM_LIMIT = 2**63  # bootstrap_room is a 63-bit id (the API accepts nothing else)
COUNT_LIMIT = 2**31  # pages, positions, slots, sizes
ADDR_LIMIT = 2**64
MAX_NAME, MAX_TEXT, MAX_AGENT = 128, 4096, 256 * 1024  # agent: base64 NIXL metadata (~0.5 KiB on UCX)
MAX_PAGES = 1 << 18  # a bound for the parser; prefill checks the count against the prompt
MAX_KV_HEADS = 1 << 16  # models have at most a few hundred; bounds head_map's per-head loop
MAX_TP_RANKS = 64  # a worker's TP ranks: bounds a handshake's `ranks` (and head_map's rank loops)

_count, _positive = uint(COUNT_LIMIT), uint(COUNT_LIMIT, lo=1)
_heads, _some_heads = uint(MAX_KV_HEADS), uint(MAX_KV_HEADS, lo=1)
_IDENTITY = record({"version": _count, "model_id": text(MAX_NAME), "dtype": text(32), "page_size": _positive,
                    "num_layers": _positive, "num_kv_heads": _some_heads, "head_dim": _positive,
                    "deterministic": boolean, "kv_scales": text(32)}, may_be_empty=True)


def _heads_fit(layout: dict[str, Any]) -> bool:
    """A layout's heads lie inside the model's (total_kv_heads 0: it holds them all)."""
    return not layout or layout["head_start"] + layout["num_kv_heads"] <= (layout["total_kv_heads"]
                                                                           or layout["num_kv_heads"])


_LAYOUT = where(record({"num_layers": _positive, "num_kv_heads": _some_heads, "head_dim": _positive,
                        "dtype": text(32), "itemsize": _positive, "page_size": _positive, "num_pages": _positive,
                        "base_ptr": uint(ADDR_LIMIT), "mem_type": one_of("DRAM", "VRAM"), "device_id": _count,
                        "head_start": _heads, "total_kv_heads": _heads}, may_be_empty=True),
                _heads_fit, "head_start + num_kv_heads over total_kv_heads")
_META = record({"addr": uint(ADDR_LIMIT), "slot_bytes": _positive, "slots": _positive}, may_be_empty=True)
_RANK = {"layout": _LAYOUT, "agent": text(MAX_AGENT), "meta": _META}  # one TP rank's agent
_HALF = {"identity": _IDENTITY, **_RANK, "ranks": list_of(record(_RANK), MAX_TP_RANKS - 1)}  # describe()
_ROOM, _NAME, _TEXT = uint(ROOM_LIMIT), text(MAX_NAME), text(MAX_TEXT)
SCHEMAS: dict[type, Spec] = {
    Hello: record({"name": _NAME, **_HALF}),
    Welcome: record({"name": _NAME, "ok": boolean, "error": _TEXT, **_HALF}),
    KVDest: record({"room": _ROOM, "pages": int_list(MAX_PAGES, COUNT_LIMIT), "skip": _count, "slot": _count,
                    "prompt_len": _positive,
                    "staging": list_of(int_list(MAX_PAGES, COUNT_LIMIT), MAX_TP_RANKS, "page lists")}),
    KVCancel: record({"room": _ROOM, "reason": _TEXT}),
    KVCancelled: record({"room": _ROOM}),
    Heartbeat: record({"name": _NAME}),
    HeartbeatAck: record({"name": _NAME, "known": boolean}),
}


def encode(msg: Message) -> bytes:
    return json.dumps({"v": PD_VERSION, "type": type(msg).__name__, "body": asdict(msg)},
                      separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    """The message in `data`, every field checked; BadMessage for anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"{len(data)} bytes: over the {MAX_MESSAGE_BYTES} byte limit")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, a 5000-digit int, 200k nested [
        raise BadMessage(f"not a JSON message ({type(exc).__name__})") from None
    if type(obj) is not dict or obj.keys() != {"v", "type", "body"}:
        raise BadMessage("not a PD message: an object with v, type and body expected")
    if obj["v"] != PD_VERSION or type(obj["v"]) is not int:
        raise BadMessage(f"PD protocol version {str(obj['v'])[:20]} != {PD_VERSION}")
    cls = PD_TYPES.get(obj["type"]) if type(obj["type"]) is str else None
    if cls is None:
        raise BadMessage(f"unknown message type {str(obj['type'])[:40]!r}")
    msg = cls(**SCHEMAS[cls](obj["body"], cls.__name__))
    if isinstance(msg, (Hello, Welcome)):
        _check_half(msg)
    return msg


def _check_half(msg: Hello | Welcome) -> None:
    """A Hello and an accepting Welcome carry a whole half (describe()); a refusal carries none of it."""
    full = not isinstance(msg, Welcome) or msg.ok
    parts = (msg.identity, msg.layout, msg.meta, msg.agent)
    if full and not (all(parts) and all(all(r.values()) for r in msg.ranks)):
        raise BadMessage(f"{type(msg).__name__}: identity, layout, agent and meta are required (of every rank)")
    if not full and (any(parts) or msg.ranks):
        raise BadMessage("a refusing Welcome carries only its error")


# Canonical decimals only (no leading zeros): what notify() writes, so one value has one form.
_NOTIFY = re.compile(rb"(0|[1-9]\d{0,18}):(0|[1-9]\d{0,9}):(0|[1-9]\d{0,9}|-)")


def notify(room: int, chunk: int, total: int | None) -> bytes:
    """NIXL notification after a chunk's WRITEs: total is set on the last one only."""
    return f"{room}:{chunk}:{'-' if total is None else total}".encode()


def parse_notify(data: bytes) -> tuple[int, int, int | None]:
    """(room, chunk, total or None); BadMessage for anything notify() does not write."""
    m = _NOTIFY.fullmatch(data) if isinstance(data, bytes) else None
    if m is None or int(m[1]) >= ROOM_LIMIT:
        raise BadMessage(f"not a KV notification ({len(data)} bytes)")
    return int(m[1]), int(m[2]), None if m[3] == b"-" else int(m[3])
