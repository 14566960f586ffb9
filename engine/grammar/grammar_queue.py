"""The grammar queue: constrained requests wait here, off the scheduler's queues, until their
grammar is compiled (SGLang's grammar queue).

Compiles run on one worker thread, so a slow schema never stalls the scheduler loop; the loop
polls the queue each iteration and admits what is ready. Compiled grammars are cached by
(kind, text) in an LRU: agents send the same schema again and again, and a hit attaches a
matcher at once, with no queueing. A failed compile is cached too, so a hostile schema sent
repeatedly costs one compile. The wait is bounded (`timeout`): a compile that overruns fails
its requests with a clear error; the thread finishes it in the background.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tandem.engine.grammar.backend import GrammarBackend, GrammarError, Matcher
from tandem.engine.grammar.registry import create_backend

Key = tuple[str, str]  # (kind, text)


@dataclass
class Waiting:
    rid: str
    item: Any  # whatever the caller wants back when the grammar is ready (a Req and its message)
    key: Key
    future: Future
    deadline: float


class GrammarQueue:
    def __init__(self, backend_name: str, tokenizer: Callable[[], Any], vocab_size: int,
                 stop_ids: Sequence[int], timeout: float = 60.0, cache_size: int = 256) -> None:
        self.backend_name, self.tokenizer = backend_name, tokenizer
        self.vocab_size, self.stop_ids = vocab_size, tuple(stop_ids)
        self.timeout, self.cache_size = timeout, cache_size
        self.cache: OrderedDict[Key, Future] = OrderedDict()
        self.waiting: dict[str, Waiting] = {}
        self.hits = self.misses = 0
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ---- the backend, built on first use (it needs the tokenizer's whole vocabulary) ----------
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = create_backend(self.backend_name, self.tokenizer(), self.vocab_size, self.stop_ids)
            return self._backend

    # ---- scheduler thread ------------------------------------------------------------------------
    def matcher_now(self, key: Key) -> Matcher | None:
        """A matcher at once if the grammar is compiled already; None means: queue with `add`."""
        fut = self.cache.get(key)
        if fut is not None and fut.done() and fut.exception() is None:
            self.cache.move_to_end(key)
            self.hits += 1
            return self.backend().matcher(fut.result())
        return None

    def add(self, rid: str, key: Key, item: Any) -> None:
        fut = self.cache.get(key)
        if fut is None:
            self.misses += 1
            fut = self._compile(key)
        else:
            self.hits += 1
            self.cache.move_to_end(key)
        self.waiting[rid] = Waiting(rid, item, key, fut, time.monotonic() + self.timeout)

    def poll(self) -> tuple[list[tuple[Any, Matcher]], list[tuple[Any, str]]]:
        """(ready items with their matchers, failed items with the reason)."""
        return self.settle(self.decide())

    def decide(self) -> list[tuple[str, str | None]]:
        """Which waiting grammars are done now: (rid, None) compiled, (rid, why) failed.
        Tensor-parallel rank 0 decides for every rank (engine/parallel/tick.py)."""
        out: list[tuple[str, str | None]] = []
        now = time.monotonic()
        for rid, w in self.waiting.items():
            if w.future.done():
                exc = w.future.exception()
                out.append((rid, None if exc is None else str(exc) if isinstance(exc, GrammarError)
                            else f"could not compile the {w.key[0]}: {exc}"))
            elif now >= w.deadline:
                out.append((rid, f"compiling the {w.key[0]} took longer than {self.timeout:g} s"))
        return out

    def settle(self, verdicts: list[tuple[str, str | None]]) -> tuple[list[tuple[Any, Matcher]], list[tuple[Any, str]]]:
        """Apply `verdicts` (decide()'s, or rank 0's): a grammar said compiled is waited for
        here if this process's compile is still running; one that failed leaves the cache so
        that a later request may try again."""
        ready: list[tuple[Any, Matcher]] = []
        failed: list[tuple[Any, str]] = []
        for rid, why in verdicts:
            w = self.waiting.pop(rid, None)
            if w is None:
                raise RuntimeError(f"grammar verdict for {rid!r}, which is not waiting here")
            if why is None:
                ready.append((w.item, self.backend().matcher(w.future.result())))
            else:
                if not w.future.done():
                    self.cache.pop(w.key, None)
                failed.append((w.item, why))
        return ready, failed

    def abort(self, rid: str) -> Any | None:
        w = self.waiting.pop(rid, None)
        return None if w is None else w.item

    def status(self) -> dict[str, int]:
        return {"grammar_waiting": len(self.waiting), "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses, "grammar_cache_size": len(self.cache)}

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: Key) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar")
        fut = self._pool.submit(lambda: self.backend().compile(*key))
        self.cache[key] = fut
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return fut
