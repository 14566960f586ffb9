"""A request's budget for the work its grammar makes the scheduler do.

A matcher runs on the scheduler thread for the whole batch: advancing it by a token and
filling its mask row. For most grammars that is microseconds, but an ambiguous EBNF (nested
stars over overlapping alternatives) grows with the output: 7 ms a token at token 40, 369 ms
at token 120, every step, for every request in the batch. So each request's matcher is
metered, and one that spends more than `per_token` seconds a token on average over its last
`window` tokens has its request ended (the scheduler does it: grammar_manager.py).

The meter reads the thread's CPU time, not the wall clock: on a loaded machine the scheduler
thread is preempted, and time it did not run is no grammar's cost. So a budget set low trips
on a pathological grammar alone, and the default, far above any sane grammar, never trips on
a slow one. A grammar slow from its first token is refused before it runs (the compile
process times its first mask against the whole window's budget: compile_worker.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.engine.grammar.backend import Matcher

if TYPE_CHECKING:
    import torch


class MeteredMatcher:
    def __init__(self, inner: Matcher, per_token: float, window: int,
                 clock: Callable[[], float] = time.thread_time) -> None:
        self.inner, self.per_token, self.clock = inner, per_token, clock
        self.steps: deque[float] = deque(maxlen=window)
        self.spent = 0.0  # in the steps held
        self.pending = 0.0  # since the last accepted token
        self.halted = False  # its request is ending: no more work for it

    def accept(self, token: int) -> bool:
        t0 = self.clock()
        ok = self.inner.accept(token)
        self.pending += self.clock() - t0
        if len(self.steps) == self.steps.maxlen:
            self.spent -= self.steps[0]
        self.steps.append(self.pending)
        self.spent += self.pending
        self.pending = 0.0
        return ok

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        if self.halted:
            return  # the row stays all-allowed: its token is dropped when the request ends
        t0 = self.clock()
        self.inner.fill_mask(mask, row)
        self.pending += self.clock() - t0

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def over_budget(self) -> str | None:
        """Why the request must end, or None. The first tokens may use the whole window's
        budget between them, so a single slow step trips it only past window * per_token."""
        window = self.steps.maxlen or 1
        spent = self.spent + self.pending
        if spent <= self.per_token * window:
            return None
        return (f"the request's grammar is too costly to follow: its matcher took {spent * 1e3:.0f} ms of CPU over "
                f"{len(self.steps)} tokens, more than {self.per_token * 1e3:g} ms a token on average over {window}")
