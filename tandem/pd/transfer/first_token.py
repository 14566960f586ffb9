"""FirstTokenSlots: a small registered buffer that carries each request's first token
(and its logprobs) from prefill to decode, in the same NIXL transfer as its last KV pages.

One slot is a row of float64 (exact for token ids below 2**53):

    [token, logprob (nan: none), n_top, top ids (MAX_TOP), top logprobs (MAX_TOP)]

Decode reserves a slot with a request's pages; prefill fills a slot of its own and
writes it into decode's. Both sides size slots the same, so the handshake can check.

The slots live on the KV buffer's device: a NIXL descriptor list holds one memory type, and
one list (one notification) must carry a request's last pages and its slot. On a GPU a
write is one synchronous host-to-device copy of the row (done before the send reads it),
a read one device-to-host copy.
"""

from __future__ import annotations

import logging
import math

import torch

from tandem.pd.protocol import MetaRegion
from tandem.protocol.logprobs import floor_logprob

log = logging.getLogger(__name__)

MAX_TOP = 20  # the OpenAI limit on top_logprobs
WIDTH = 3 + 2 * MAX_TOP


def _is_logprob(x: float) -> bool:
    """-inf included; NaN, +inf and positive numbers are no logprob."""
    return x <= 0.0


class FirstTokenSlots:
    def __init__(self, slots: int, device: torch.device | str = "cpu") -> None:
        self.buf = torch.zeros(slots, WIDTH, dtype=torch.float64, device=device)
        self.free = list(range(slots - 1, -1, -1))
        self.capacity = slots

    def region(self) -> MetaRegion:
        return MetaRegion(self.buf.data_ptr(), WIDTH * 8, self.capacity)

    def alloc(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.capacity:
            # A bug of this process (both roles free only slots they took, once): ignored, the
            # slot stays free once, and it costs a log line instead of the worker.
            log.error("first-token slot %d freed twice or never taken", slot)
            return
        self.free.append(slot)

    def write(self, slot: int, token: int, logprob: float | None, top: list[tuple[int, float]]) -> None:
        top = top[:MAX_TOP]
        row = [0.0] * WIDTH
        row[0], row[1], row[2] = token, math.nan if logprob is None else logprob, len(top)
        for i, (t, lp) in enumerate(top):
            row[3 + i], row[3 + MAX_TOP + i] = t, lp
        # Blocking: NIXL reads the slot as soon as send() posts the WRITE, outside any stream.
        self.buf[slot].copy_(torch.tensor(row, dtype=torch.float64), non_blocking=False)

    def read(self, slot: int, vocab_size: int = 2**53) -> tuple[int, float | None, list[tuple[int, float]]]:
        """The slot's (token, logprob or None, top). A peer wrote it: a ValueError says what is
        not a token below `vocab_size`, a count up to MAX_TOP, or a logprob (a number up to 0).
        A logprob of -inf is a token the grammar ruled out, which a prefill of an older release
        sends as it is: it reads as the floor every route reports (tandem/protocol/logprobs.py)."""
        row = self.buf[slot].tolist()
        n = row[2]
        if not (n.is_integer() and 0 <= n <= MAX_TOP):
            raise ValueError(f"top count {n} outside 0..{MAX_TOP}")
        ids, lps = row[3 : 3 + int(n)], row[3 + MAX_TOP : 3 + MAX_TOP + int(n)]
        bad = [t for t in (row[0], *ids) if not (t.is_integer() and 0 <= t < vocab_size)]  # nan, inf: not integer
        if bad:
            raise ValueError(f"token {bad[0]} outside the vocabulary (0..{vocab_size - 1})")
        if not all(_is_logprob(lp) for lp in lps) or not (math.isnan(row[1]) or _is_logprob(row[1])):
            raise ValueError("a logprob that is not a number up to 0")
        logprob = None if math.isnan(row[1]) else floor_logprob(row[1])
        return int(row[0]), logprob, [(int(t), floor_logprob(lp)) for t, lp in zip(ids, lps)]

    def check_integrity(self, in_use: int = 0) -> None:
        # The idle self-check's language (as the engine's pools): only this process's bugs fail it.
        assert len(set(self.free)) == len(self.free), "a first-token slot is free twice"
        assert len(self.free) + in_use == self.capacity, (
            f"{self.capacity - len(self.free)} first-token slots in use, {in_use} expected")
