"""KV cache events, the wire side: what a worker's prefix cache stores and removes, block by block
and tier by tier, for a router to follow the cache exactly (llm-d's KV-cache indexer, Dynamo's KV
router, our own `kv_events` policy: router/kv_event_index.py) instead of guessing it from the
requests it routed. Torch-free: the worker (engine/kvcache/kv_events.py) writes these, the
router reads them.

A block is one page (`block_size` = the page size). Its hash chains its tokens to its
parent's, so a block's hash names the whole prefix it ends:

    hash(block) = blake2b-64(parent hash, the block's token ids)   (None for the first block)

The events and their wire form are vLLM's `KVEvents` (vllm/distributed/kv_events.py, the
array form its msgspec Structs had with `array_like=True`, which Dynamo's decoder reads
positionally and llm-d's indexer was written against):

    batch   [ts, [event, ...], data_parallel_rank]
    stored  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    removed ["BlockRemoved", block_hashes, medium]
    cleared ["AllBlocksCleared"]

`medium` is the tier a block lives in: "GPU" for the device pool (on a CPU worker too: it is
the engine's first tier), "CPU_PINNED" for the host tier (kvcache/host_tier.py). A block moved
from the device to the host is removed from one and stored in the other. The ZMQ transport is
engine/kvcache/event_publisher.py.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

DEVICE, HOST = "GPU", "CPU_PINNED"
_HASH_MASK = (1 << 63) - 1  # a signed 64-bit consumer (Dynamo takes i64 or u64) reads it as positive


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config fields that apply here (SGLang takes the same JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"  # bind when it has "*" or is ipc/inproc, else connect; + DP rank
    bind: bool | None = None  # ours, not vLLM's: force bind (true) or connect (false); null: as above
    replay_endpoint: str | None = None  # ROUTER for replays of missed batches; + DP rank
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def binds(self, endpoint: str) -> bool:
        """Whether the publisher binds `endpoint` (vLLM's rule unless `bind` says)."""
        if self.bind is not None:
            return self.bind
        return any(m in endpoint for m in ("*", "::")) or endpoint.startswith(("ipc://", "inproc://"))

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        """The JSON of --kv-events-config; ValueError naming what is wrong."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
        cfg = cls(**raw)
        if cfg.bind not in (None, True, False):
            raise ValueError("kv_events_config.bind must be true, false or null")
        if not isinstance(cfg.enable_kv_cache_events, bool) or cfg.publisher not in ("zmq", "null"):
            raise ValueError("kv_events_config: enable_kv_cache_events must be true/false and publisher zmq or null")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, name), str) or len(getattr(cfg, name)) > 256:
                raise ValueError(f"kv_events_config.{name} must be a string of at most 256 characters")
        if cfg.replay_endpoint is not None and (not isinstance(cfg.replay_endpoint, str)
                                                or len(cfg.replay_endpoint) > 256):
            raise ValueError("kv_events_config.replay_endpoint must be a string of at most 256 characters")
        for name in ("buffer_steps", "hwm"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000_000:
                raise ValueError(f"kv_events_config.{name} must be an integer in 1..10000000")
        if cfg.enabled and not cfg.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("kv_events_config.endpoint must be tcp://, ipc:// or inproc://")
        return cfg


def block_hashes(parent: int | None, tokens: list[int], block_size: int) -> list[int]:
    """The chained hash of each whole block of `tokens`, after a block whose hash is `parent`."""
    out = []
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(b"-" if parent is None else parent.to_bytes(8, "little"))
        h.update(struct.pack(f"<{block_size}i", *tokens[i : i + block_size]))  # one call, not one a token
        parent = int.from_bytes(h.digest(), "little") & _HASH_MASK
        out.append(parent)
    return out
