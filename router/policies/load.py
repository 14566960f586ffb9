"""Policies that look at load only, not at what a worker has cached."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tandem.router.policies.base import Policy, least_tokens
from tandem.router.prefix_index import PrefixIndex
from tandem.router.workers import Worker


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, index: PrefixIndex | None = None, seed: int | None = None) -> None:
        super().__init__(index, seed)
        self._turn = itertools.count()

    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        return workers[next(self._turn) % len(workers)], 0


class Uniform(Policy):
    name = "random"

    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        return self.rng.choice(list(workers)), 0


class LeastRequests(Policy):
    name = "least_requests"

    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        return min(workers, key=lambda x: (x.requests, x.tokens)), 0


class LeastTokens(Policy):
    """Fewest outstanding tokens: prompt + max_tokens of the requests in flight."""

    name = "least_tokens"
    reads_tokens = True

    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        return least_tokens(workers), 0


class PowerOfTwo(Policy):
    """The less loaded (by tokens) of two workers drawn at random."""

    name = "power_of_two"
    reads_tokens = True

    def pick(self, workers: Sequence[Worker], ids: Sequence[int]) -> tuple[Worker, int]:
        return least_tokens(self.rng.sample(list(workers), min(2, len(workers)))), 0
