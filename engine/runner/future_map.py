"""FutureMap: lets batch N+1 be built before batch N's tokens exist.

When batch N launches, each of its requests gets a future slot; the batch's
`output_ids` become `-slot`. Whatever later batch consumes them carries the
negative ids in `input_ids`, and the worker resolves them on the device, after
batch N (earlier on the same stream / worker thread) has stored its samples:

    input_ids = [ 17, -5, -6 ]  ->  [ 17, buf[5], buf[6] ]

Slots are handed out round-robin from a ring; slot 0 is unused so every
future id is strictly negative. The ring only needs to outlive the steps in
flight (at most two batches), so a few multiples of max_running_requests are
plenty.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, max_running_requests: int, device: torch.device | str) -> None:
        self.size = 4 * max_running_requests + 1
        self.buf = torch.zeros(self.size, dtype=torch.int64, device=device)
        self._next = 1

    def alloc(self, n: int) -> torch.Tensor:
        """n fresh slot indices (positive); consumers see them negated."""
        if n > self.size - 1:
            raise ValueError("batch larger than the future ring")
        if self._next + n > self.size:
            self._next = 1
        idx = torch.arange(self._next, self._next + n, dtype=torch.int64)
        self._next += n
        return idx

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        # clamp keeps the gather in range for real ids; where() then ignores those lanes.
        return torch.where(input_ids < 0, self.buf[(-input_ids).clamp(min=0)], input_ids)

    def store(self, idx: torch.Tensor, token_ids: torch.Tensor) -> None:
        # idx is a run from alloc(), so a slice: indexing with idx would copy it to the device
        # synchronously, and on a GPU the forward thread would wait there for the whole step.
        start = int(idx[0])
        self.buf[start : start + len(idx)] = token_ids
