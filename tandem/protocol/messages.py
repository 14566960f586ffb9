"""Typed messages between a worker's front (the HTTP server or the offline Engine)
and its schedulers.

Grouped by direction and kind. A request is named by `rid` everywhere. Requests
(`GenerateReq`, `AbortReq`) and admin commands (answered by an `AdminResult` with
the command's `rid`) are dispatched from separate tables, so a receiver states once
what it does with each type. Anything crossing a process is JSON with a version
field (`encode` / `decode`), never a pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

WIRE_VERSION = 2


# ---- front -> scheduler: requests ----------------------------------------------------------
@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams.make(**sampling)
    priority: int = 0
    # PD bootstrap (SGLang's names): where decode finds the prefill side of this request.
    # `bootstrap_room` also routes follow_bootstrap_room DP dispatch.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class AbortReq:
    rid: str


# ---- front -> scheduler: admin commands (each answered by one AdminResult per rank) --------
@dataclass
class FlushCacheReq:
    """Drop the prefix cache if idle, check integrity."""

    rid: str = "flush"


@dataclass
class StatusReq:
    """Load and KV-pool state; when idle, the pool's integrity check runs too."""

    rid: str = "status"


@dataclass
class ShutdownReq:
    rid: str = "shutdown"


# ---- scheduler -> front -----------------------------------------------------------------------
@dataclass
class ReqOutput:
    """New tokens of one request since its previous ReqOutput."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: dict[str, Any] | None = None  # {"kind", "matched", "message"}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None  # per token: [[id, logprob], ...]
    ttft: float | None = None  # seconds from arrival to first token
    retract_count: int = 0


@dataclass
class AdminResult:
    rid: str
    ok: bool
    info: dict[str, Any] = field(default_factory=dict)


REQUEST_TYPES: tuple[type, ...] = (GenerateReq, AbortReq)
ADMIN_TYPES: tuple[type, ...] = (FlushCacheReq, StatusReq, ShutdownReq)
OUTPUT_TYPES: tuple[type, ...] = (ReqOutput, AdminResult)
_TYPES = {t.__name__: t for t in (*REQUEST_TYPES, *ADMIN_TYPES, *OUTPUT_TYPES)}


def is_admin(msg: Any) -> bool:
    return isinstance(msg, ADMIN_TYPES)


def dispatch(msg: Any, table: Mapping[type, Callable[[Any], Any]]) -> Any:
    """Call the handler of msg's exact type; a type the table lacks is a wiring bug."""
    try:
        handler = table[type(msg)]
    except KeyError:
        raise TypeError(f"no handler for {type(msg).__name__}") from None
    return handler(msg)


def encode(msg: Any) -> bytes:
    # The fields are JSON values already: the instance dict serialises as it is (asdict's
    # deep copy cost ~10 us per output, per request per step, in the scheduler process).
    return json.dumps({"v": WIRE_VERSION, "type": type(msg).__name__, "body": msg.__dict__},
                      separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    obj = json.loads(data)
    if obj.get("v") != WIRE_VERSION:
        raise ValueError(f"wire version {obj.get('v')} != {WIRE_VERSION}")
    return _TYPES[obj["type"]](**obj["body"])
