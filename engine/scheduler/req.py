"""Req: one generation request and its lifecycle.

    WAITING --admitted--> EXTENDING --last chunk--> DECODING --stop--> FINISHED
       ^                     |  ^                      |
       |                     v  | next round           |
       |                   CHUNKED                      |
       +------- RETRACTED <-----------------------------+  (KV reclaimed; re-prefilled later)

Token bookkeeping for one round of prefill (SGLang's names):

    fill_ids         = origin_input_ids + output_ids  (possibly truncated to a chunk)
    prefix_indices   = KV slots of the cached prefix (radix hit or earlier chunks)
    extend_input_len = len(fill_ids) - len(prefix_indices)   (tokens to compute now)

The cached prefix is capped at input_len - 1: the last token must be computed
to produce the logits the next token is sampled from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from tandem.engine.sampling_params import SamplingParams


class ReqStatus(Enum):
    WAITING = "waiting"
    EXTENDING = "extending"
    CHUNKED = "chunked"
    DECODING = "decoding"
    RETRACTED = "retracted"
    FINISHED = "finished"


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "length" | "stop" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    message: str = ""
    status: int = 400  # an abort before any token: the HTTP status (503: a fault of ours, retryable)

    def to_openai(self) -> str:
        return {"length": "length", "stop": "stop", "abort": "abort"}[self.kind]


class KVFate(Enum):
    """What becomes of a request's KV when it ends (lifecycle.retire)."""

    CACHE = "cache"  # into the prefix cache: the normal end (a role part may hold it first)
    DISCARD = "discard"  # freed, never cached: half-written by a failed forward, or a transfer's never-filled room
    HOLD = "hold"  # kept, with its row and registry entry, until its holder calls release_held


def finish_length(n: int) -> FinishReason:
    return FinishReason("length", message=f"reached max_new_tokens={n}")


def finish_abort(message: str, status: int = 400) -> FinishReason:
    return FinishReason("abort", message=message, status=status)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # --- mutable state ---
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    extend_input_len: int = 0
    req_pool_idx: int | None = None
    # Positions [0, kv_committed_len) have KV slots in our row, written or being written by
    # a forward already launched (under overlap, one step may still be in flight).
    kv_committed_len: int = 0
    cached_tokens: int = 0  # prefix-cache hit tokens, for metrics
    is_chunked: int = 0  # > 0 while chunks of this request are in flight
    is_retracted: bool = False
    retract_count: int = 0
    finished_reason: FinishReason | None = None
    to_finish: FinishReason | None = None  # set mid-step (abort), applied at the next check
    # streaming / timing
    stream_offset: int = 0  # output tokens already streamed
    first_token_time: float | None = None
    last_token_time: float | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    detok: Any = None  # incremental detokenizer state (engine/detokenizer.py)
    # The structured-output matcher (engine/grammar/): it has accepted exactly output_ids.
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.origin_input_ids:
            raise ValueError("a request needs at least one input token")
        self.check_invariants()

    # ---- derived --------------------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def kv_token_ids(self) -> list[int]:
        """Tokens whose KV is stored in our req_to_token row, positions [0, kv_committed_len)."""
        return (self.origin_input_ids + self.output_ids)[: self.kv_committed_len]

    def check_invariants(self) -> None:
        # +1: under overlap the slot of a sampled-but-unprocessed token is already committed.
        assert 0 <= self.kv_committed_len <= self.seqlen + 1, self.rid
        assert self.req_pool_idx is not None or self.kv_committed_len == 0, self.rid
        if self.status in (ReqStatus.EXTENDING, ReqStatus.CHUNKED):  # fill_ids is this round's input
            assert self.prefix_len <= len(self.fill_ids), self.rid
        assert self.extend_input_len >= 0, self.rid

    # ---- scheduling ------------------------------------------------------------------------
    def init_next_round_input(self, tree_cache: Any) -> None:
        """Recompute fill_ids and the reusable prefix before an extend round.

        A new (or retracted) request matches the prefix cache; a chunked one
        resumes from the KV already in its own row."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if self.req_pool_idx is None:
            match = tree_cache.match_and_load(self.fill_ids[: len(self.fill_ids) - 1])
            self.prefix_indices, self.last_node = match.indices, match.last_node
            self.cached_tokens = len(self.prefix_indices)
        self.extend_input_len = len(self.fill_ids) - self.prefix_len

    @property
    def prefix_len(self) -> int:
        """Positions whose KV the next extend reuses: the cache hit for a new request,
        everything already in its row for a chunked one."""
        return self.kv_committed_len if self.req_pool_idx is not None else len(self.prefix_indices)

    def set_extend_input_len(self, n: int) -> None:
        """Truncate this round to n new tokens (a chunk)."""
        self.extend_input_len = n
        self.fill_ids = self.fill_ids[: self.prefix_len + n]

    def reset_for_retract(self) -> None:
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.extend_input_len = 0
        self.is_chunked = 0
        self.is_retracted = True
        self.retract_count += 1
        self.status = ReqStatus.RETRACTED
