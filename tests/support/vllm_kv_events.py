"""The consumer's schema for KV events: vLLM's msgspec Structs in the array-like form of
vllm/distributed/kv_events.py (v0.11, with `lora_name`), the form vLLM's own subscriber example
decodes and that Dynamo's decoder (lib/kv-router, RawKvEvent) reads by position. Decoding with
these types, strictly, is the contract test: a field out of place or of the wrong type fails.

    EventBatch   [ts, events, data_parallel_rank]
    BlockStored  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    BlockRemoved ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]
"""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events: the tag is the class name, first in the array."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode


class Index:
    """What a router rebuilds from the events alone: per medium, the block hashes held and,
    for each, its parent and tokens."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[int, tuple[int | None, tuple[int, ...]]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(ev, BlockStored):
                held = self.blocks.setdefault(ev.medium or "GPU", {})
                parent, size = ev.parent_block_hash, ev.block_size
                assert len(ev.token_ids) == size * len(ev.block_hashes), "a stored block's tokens are not whole"
                for i, h in enumerate(ev.block_hashes):
                    assert h not in held, f"block {h} stored twice in {ev.medium}"
                    held[h] = (parent, tuple(ev.token_ids[i * size : (i + 1) * size]))
                    parent = h
            else:
                held = self.blocks.setdefault(ev.medium or "GPU", {})
                for h in ev.block_hashes:
                    assert h in held, f"block {h} removed from {ev.medium} but never stored there"
                    del held[h]

    def hashes(self, medium: str) -> set[int]:
        return set(self.blocks.get(medium, {}))
