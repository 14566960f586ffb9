"""Typed messages between the engine front (Engine / servers) and schedulers.

Grouped by direction. Anything crossing a process is a dataclass serialised to
JSON with a version field (`encode` / `decode`), never a pickle.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

WIRE_VERSION = 1


# ---- front -> scheduler -----------------------------------------------------------------
@dataclass
class GenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams.make(**sampling)
    priority: int = 0
    bootstrap_room: int | None = None  # PD / follow_bootstrap_room DP dispatch


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    """Drop the prefix cache if idle, check integrity, and answer with an AdminResult."""

    request_id: str = "flush"


@dataclass
class ShutdownReq:
    pass


# ---- scheduler -> front -----------------------------------------------------------------
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
    request_id: str
    ok: bool
    info: dict[str, Any] = field(default_factory=dict)


_TYPES = {t.__name__: t for t in (
    GenerateReqInput, AbortReq, FlushCacheReq, ShutdownReq, ReqOutput, AdminResult)}


def encode(msg: Any) -> bytes:
    return json.dumps({"v": WIRE_VERSION, "type": type(msg).__name__, "body": dataclasses.asdict(msg)}).encode()


def decode(data: bytes) -> Any:
    obj = json.loads(data)
    if obj.get("v") != WIRE_VERSION:
        raise ValueError(f"wire version {obj.get('v')} != {WIRE_VERSION}")
    return _TYPES[obj["type"]](**obj["body"])
