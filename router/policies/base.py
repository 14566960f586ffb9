"""What every dispatch policy is: given the eligible workers and a prompt's token ids, pick one."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from tandem.router.kv_event_index import EventIndex
from tandem.router.prefix_index import PrefixIndex
from tandem.router.workers import Worker


class Policy(ABC):
    name: ClassVar[str]
    # Whether pick() reads the prompt's token ids: the proxy tokenizes a request only for
    # such a policy (or in PD mode, which pairs a prefill with a decode by prefix).
    reads_tokens: ClassVar[bool] = False

    def __init__(self, index: PrefixIndex | EventIndex | None = None, seed: int | None = None) -> None:
        # What each worker is estimated to hold: cache_aware fills it, PD pairing reads it.
        self.index = index or PrefixIndex()
        self.rng = random.Random(seed)
        self.hits = self.misses = 0  # cache_aware's picks by prefix and by load (the router's metrics)

    @classmethod
    def configured(cls, *, threshold: float, balance: float, seed: int | None) -> Policy:
        """The policy as the router configures it; cache_aware reads the knobs, the rest ignore them."""
        return cls(seed=seed)

    @abstractmethod
    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        """(worker, estimated cached prefix tokens on it); `workers` is never empty."""


def least_tokens(workers: Sequence[Worker]) -> Worker:
    return min(workers, key=lambda x: (x.tokens, x.requests))
