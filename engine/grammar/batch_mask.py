"""One batch's vocabulary mask, handed from the scheduler thread to the forward thread.

The mask of batch N depends on every token before it. In the normal loop those are all
processed when N is launched, so the scheduler fills the mask first. In the overlap loop N is
launched before N-1's tokens are processed: the forward thread computes N's logits, then
waits here; the scheduler processes N-1 (advancing each matcher), fills N's mask, and the
forward thread applies it and samples (SGLang's delayed sampling). The wait costs only the
processing of N-1, which the forward of N has already overlapped.

Whatever happens on the scheduler side, the forward thread is released: `fail` hands it
the exception, which then fails batch N's requests instead of hanging the thread.
"""

from __future__ import annotations

import threading

import torch

from tandem.engine.grammar.backend import GrammarBackend, Matcher


class BatchMask:
    def __init__(self, backend: GrammarBackend, matchers: list[Matcher | None]) -> None:
        self.backend = backend
        self.matchers = matchers  # one per sampled row; None: unconstrained
        self._done = threading.Event()
        self._mask: torch.Tensor | None = None
        self._error: BaseException | None = None

    def fill(self) -> None:
        """Scheduler thread, once every earlier batch is processed."""
        if self._done.is_set():
            return
        try:
            mask = self.backend.allocate_mask(len(self.matchers))  # rows start all-allowed
            for row, m in enumerate(self.matchers):
                # A terminated matcher belongs to a request that just finished: its row is
                # sampled but discarded.
                if m is not None and not m.is_terminated():
                    m.fill_mask(mask, row)
            self._mask = mask
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._done.set()

    def fail(self, exc: BaseException) -> None:
        if not self._done.is_set():
            self._error = exc
            self._done.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Forward thread: wait for the mask, then mask the logits in place."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"the batch's grammar mask failed: {self._error}") from self._error
        assert self._mask is not None  # invariant: fill() sets the mask before it sets _done
        self.backend.apply_mask(logits, self._mask)
