"""The engine's side of KV events (the message shape, the block hash and the config are
tandem/protocol/kv_events.py): the prefix cache (radix_cache.py) logs what it stores and removes
during a step, and the scheduler drains the log into one batch a step for the publisher
(event_publisher.py)."""

from __future__ import annotations

import time
from typing import Any

from tandem.protocol.kv_events import DEVICE, HOST, KVEventsConfig, block_hashes

__all__ = ["DEVICE", "HOST", "KVEventLog", "KVEventsConfig", "block_hashes"]


class KVEventLog:
    """The events of one scheduler step, in order; the scheduler drains them into one batch."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[list[Any]] = []

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], medium: str) -> None:
        if hashes:
            self._events.append(["BlockStored", hashes, parent, tokens, self.block_size, None, medium, None])

    def removed(self, hashes: list[int], medium: str) -> None:
        if hashes:
            self._events.append(["BlockRemoved", hashes, medium])

    def cleared(self) -> None:
        self._events = [["AllBlocksCleared"]]  # what came before it in this step no longer matters

    def drain(self, dp_rank: int) -> list[Any] | None:
        """This step's batch in the wire form, or None without events."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return [time.time(), events, dp_rank]
