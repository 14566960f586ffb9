"""FutureMap: lets batch N+1 be built before batch N's tokens exist.

When batch N launches, each of its requests gets a future slot; the batch's
`output_ids` become `-slot`. Whatever later batch consumes them carries the
negative ids in `input_ids`, and the forward resolves them on the device, after
batch N (earlier on the same stream / worker thread) has stored its samples:

    input_ids = [ 17, -5, -6 ]  ->  [ 17, buf[5], buf[6] ]

Slots are handed out round-robin from a ring as runs (`range`s): the host never builds
a tensor of them, and the store is a slice. Slot 0 is never handed out, so every future
id is strictly negative; padded rows of a graph-captured decode store into it. The ring
only needs to outlive the steps in flight (at most two batches), so a few multiples of
max_running_requests are plenty. The model runner owns the ring: its CUDA graphs resolve
and store futures inside the replay (runner/graph_inputs.py).
"""

from __future__ import annotations

import numpy as np
import torch


class FutureMap:
    def __init__(self, max_running_requests: int, device: torch.device | str) -> None:
        self.size = 4 * max_running_requests + 1
        self.buf = torch.zeros(self.size, dtype=torch.int64, device=device)
        self._next = 1

    def alloc(self, n: int) -> range:
        """n fresh slots (positive); consumers see them negated (`ids`)."""
        if n > self.size - 1:
            raise ValueError("batch larger than the future ring")
        if self._next + n > self.size:
            self._next = 1
        slots = range(self._next, self._next + n)
        self._next += n
        return slots

    @staticmethod
    def ids(slots: range) -> np.ndarray:
        """The future ids of `slots` (int64), as the scheduler's batches hold ids."""
        return -np.arange(slots.start, slots.stop, dtype=np.int64)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        # clamp keeps the gather in range for real ids; where() then ignores those lanes.
        return torch.where(input_ids < 0, self.buf[(-input_ids).clamp(min=0)], input_ids)

    def store(self, slots: range, token_ids: torch.Tensor) -> None:
        # A slice: indexing with a tensor of slots would copy it to the device synchronously, and
        # on a GPU the forward thread would wait there for the whole step.
        self.buf[slots.start : slots.stop] = token_ids
