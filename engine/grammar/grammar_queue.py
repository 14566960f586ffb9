"""The grammar queue: constrained requests wait here, off the scheduler's queues, until their
grammar is compiled (SGLang's grammar queue).

Compiles run in child processes (compile_pool.py), so a slow schema never stalls the
scheduler loop, and one past its deadline is killed; the loop polls the queue each iteration
and admits what is ready. Grammars are cached (grammar_cache.py), failures too, and requests
for a constraint already compiling share that compile. A request's wait is bounded
(`timeout`); its compile goes on for the others that wait for it, or until its own deadline.

Tensor parallelism: rank 0 decides (decide) and every rank applies its verdicts (settle). A
follower rank (`follow`) has no deadline, no CPU probe and no queue bound of its own, which
could tell it otherwise than rank 0; it stops a compile when rank 0 says it failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from tandem.engine.grammar.backend import GrammarBackend, GrammarError, Matcher
from tandem.engine.grammar.compile_pool import CompileBusy, CompilePool, PoolLimits
from tandem.engine.grammar.grammar_cache import GrammarCache, Key
from tandem.engine.grammar.registry import create_backend

# (rid, None: compiled | why it failed, the HTTP status of that failure)
Verdict = tuple[str, str | None, int]


@dataclass
class Waiting:
    rid: str
    item: Any  # whatever the caller wants back when the grammar is ready (a Req and its message)
    key: Key
    future: Future  # -> (compiled, bytes)
    deadline: float


class GrammarQueue:
    def __init__(self, backend_name: str, tokenizer: Callable[[], Any], vocab_size: int,
                 stop_ids: Sequence[int], timeout: float = 60.0, cache_size: int = 256,
                 cache_bytes: int = 256 * 2**20, limits: PoolLimits = PoolLimits(), follow: bool = False) -> None:
        self.backend_name, self.tokenizer = backend_name, tokenizer
        self.vocab_size, self.stop_ids = vocab_size, tuple(stop_ids)
        self.timeout, self.follow = timeout, follow
        self.cache = GrammarCache(cache_size, cache_bytes)
        self.inflight: dict[Key, Future] = {}
        self.waiting: dict[str, Waiting] = {}
        self.hits = self.misses = 0
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        if follow:
            limits = replace(limits, timeout=None, max_pending=None, probe_limit=float("inf"))
        else:
            limits = replace(limits, timeout=timeout)
        self.pool = CompilePool(self.backend, backend_name, limits)

    # ---- the backend, built on first use (it needs the tokenizer's whole vocabulary) ----------
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = create_backend(self.backend_name, self.tokenizer(), self.vocab_size, self.stop_ids)
            return self._backend

    # ---- scheduler thread ------------------------------------------------------------------------
    def matcher_now(self, key: Key) -> Matcher | None:
        """A matcher at once if the grammar is compiled already; None means: queue with `add`."""
        compiled = self.cache.get(key)
        if compiled is None:
            return None
        self.hits += 1
        return self.backend().matcher(compiled)

    def add(self, rid: str, key: Key, item: Any) -> None:
        self.waiting[rid] = Waiting(rid, item, key, self._future(key), time.monotonic() + self.timeout)

    def _future(self, key: Key) -> Future:
        fut = self.inflight.get(key)
        if fut is not None:
            self.hits += 1
            return fut
        fut = Future()
        compiled = self.cache.get(key)
        failure = None if self.follow else self.cache.failure(key, time.monotonic())
        if compiled is not None:
            self.hits += 1
            fut.set_result((compiled, 0))
        elif failure is not None:
            self.hits += 1
            fut.set_exception(_failure(*failure))
        else:
            self.misses += 1
            fut = self.inflight[key] = self.pool.submit(key)
        return fut

    def poll(self) -> tuple[list[tuple[Any, Matcher]], list[tuple[Any, str, int]]]:
        """(ready items with their matchers, failed items with the reason and its status)."""
        return self.settle(self.decide())

    def decide(self) -> list[Verdict]:
        """Which waiting grammars are done now. Tensor-parallel rank 0 decides for every rank
        (engine/parallel/tick.py)."""
        self._harvest()
        out: list[Verdict] = []
        now = time.monotonic()
        for rid, w in self.waiting.items():
            if w.future.done():
                out.append((rid, *_outcome(w)))
            elif now >= w.deadline:
                out.append((rid, f"compiling the {w.key[0]} took longer than {self.timeout:g} s", 400))
        return out

    def settle(self, verdicts: list[Verdict]) -> tuple[list[tuple[Any, Matcher]], list[tuple[Any, str, int]]]:
        """Apply `verdicts` (decide()'s, or rank 0's): a grammar said compiled is waited for
        here if this process's compile is still running."""
        ready: list[tuple[Any, Matcher]] = []
        failed: list[tuple[Any, str, int]] = []
        for rid, why, status in verdicts:
            # Rank 0 decides before the aborts that arrive in the same tick are applied: a
            # request they removed has no verdict to take, on any rank.
            w = self.waiting.pop(rid, None)
            if w is None:
                continue
            if why is None:
                ready.append((w.item, self.backend().matcher(self._compiled(w))))
            else:
                failed.append((w.item, why, status))
                self._release(w)
        self._harvest()
        return ready, failed

    def abort(self, rid: str) -> Any | None:
        w = self.waiting.pop(rid, None)
        if w is None:
            return None
        self._release(w)
        return w.item

    def status(self) -> dict[str, int]:
        return {"grammar_waiting": len(self.waiting), "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses, "grammar_cache_size": len(self.cache),
                "grammar_cache_bytes": self.cache.bytes, "grammar_compiling": len(self.inflight),
                "grammar_compile_pending": self.pool.pending()}

    def shutdown(self) -> None:
        self.pool.shutdown()

    # ---- internals --------------------------------------------------------------------------------
    def _compiled(self, w: Waiting) -> Any:
        try:
            return w.future.result()[0]
        except BaseException as exc:
            # Rank 0's compile of this text succeeded: the ranks can no longer admit alike.
            raise RuntimeError(f"rank 0 compiled the {w.key[0]} of {w.rid!r}, this rank could not: {exc}") from exc

    def _harvest(self) -> None:
        """Finished compiles go from in flight to the cache (or to the remembered failures)."""
        now = time.monotonic()
        for key, fut in [(k, f) for k, f in self.inflight.items() if f.done()]:
            del self.inflight[key]
            if fut.cancelled():
                continue
            exc = fut.exception()
            if exc is None:
                self.cache.put(key, *fut.result())
            elif isinstance(exc, GrammarError) and not isinstance(exc, CompileBusy) and not self.follow:
                self.cache.fail(key, str(exc), exc.status, now)

    def _release(self, w: Waiting) -> None:
        """`w` no longer waits: a compile nobody else waits for is dropped if it has not started.
        One running goes on to its deadline and is cached either way, so a resend joins it
        instead of starting over; a follower, which has no deadline, stops it."""
        if w.future.done() or any(o.future is w.future for o in self.waiting.values()):
            return
        if self.follow:
            self.pool.cancel(w.future, kill=True)
            self.inflight.pop(w.key, None)
        elif self.pool.cancel(w.future, kill=False):
            self.inflight.pop(w.key, None)


def _outcome(w: Waiting) -> tuple[str | None, int]:
    if w.future.cancelled():
        return f"the {w.key[0]} compile was cancelled", 503
    exc = w.future.exception()
    if exc is None:
        return None, 0
    if isinstance(exc, GrammarError):
        return str(exc), exc.status
    return f"could not compile the {w.key[0]}: {exc}", 500


def _failure(why: str, status: int) -> GrammarError:
    exc = GrammarError(why)
    exc.status = status
    return exc
