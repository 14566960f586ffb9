"""Grammar compiles in child processes that can be killed (compile_worker.py).

A compile cannot be cancelled inside xgrammar: on a thread, one past its deadline failed its
request but kept the only compile thread busy, and every other schema on the worker waited.
Here each of a few slots (threads) owns one child process. A job that overruns its deadline
gets its child killed, so it stops costing CPU, and the slot starts a fresh child for the
next job. The pending jobs are bounded: past the bound a compile is refused at once (429),
never queued behind minutes of others.

Slots and their children start on demand (a child imports torch and the backend: seconds),
and the deadline counts from when a ready child takes the job, not from its start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tandem.engine.grammar.backend import GrammarBackend, GrammarError

Key = tuple[str, str]  # (kind, text)

# How long a child may take to start (import torch and the backend, read the vocabulary): a
# loaded machine takes seconds; past this the compile fails with a server error, not a hang.
CHILD_START_TIMEOUT = 300.0


class CompileTimeout(GrammarError):
    """The compile ran past its deadline and was killed."""


class CompileBusy(GrammarError):
    """Too many compiles pending: refused at once; the client may try again later."""

    status = 429


@dataclass(frozen=True)
class PoolLimits:
    workers: int = 2  # child processes at most
    max_pending: int | None = 16  # jobs waiting for a child; None: unbounded (a TP follower)
    timeout: float | None = 60.0  # seconds of a child's time per job; None: until cancelled
    max_bytes: int = 16 * 2**20  # a grammar's memory and its serialized text, each
    probe_limit: float = 0.16  # CPU seconds its first vocabulary mask may take


@dataclass
class _Job:
    key: Key
    future: Future


class _Child:
    """One compile process and its two pipes. Only its slot's thread reads or closes the pipes;
    another thread may kill the process, which the slot then reads as the pipe's end."""

    def __init__(self) -> None:
        job_r, job_w = os.pipe()
        res_r, res_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.engine.grammar.compile_worker", str(job_r), str(res_w)],
                pass_fds=(job_r, res_w), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (job_r, job_w, res_r, res_w):
                os.close(fd)
            raise
        os.close(job_r)
        os.close(res_w)
        self.jobs, self.results = Connection(job_w, readable=False), Connection(res_r, writable=False)

    def handshake(self, backend_name: str, spec: str, limits: PoolLimits) -> None:
        self.jobs.send_bytes(json.dumps({"backend": backend_name, "spec": spec, "max_bytes": limits.max_bytes,
                                         "probe_limit": limits.probe_limit}).encode())
        if not self.results.poll(CHILD_START_TIMEOUT) or json.loads(self.results.recv_bytes()) != {"ready": True}:
            raise EOFError("no answer")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.jobs.close()
        self.results.close()


class CompilePool:
    def __init__(self, backend: Callable[[], GrammarBackend], backend_name: str, limits: PoolLimits) -> None:
        self.backend, self.backend_name, self.limits = backend, backend_name, limits
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._slots: list[_Slot] = []
        self._closed = False

    def submit(self, key: Key) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                fut.set_exception(RuntimeError("the grammar compile pool is shut down"))
            elif self.limits.max_pending is not None and len(self._jobs) >= self.limits.max_pending:
                fut.set_exception(CompileBusy(f"too many grammars are being compiled ({len(self._jobs)} waiting); "
                                              "try again later"))
            else:
                self._jobs.append(_Job(key, fut))
                idle = sum(s.job is None for s in self._slots)
                if idle < len(self._jobs) and len(self._slots) < self.limits.workers:
                    slot = _Slot(self)
                    self._slots.append(slot)
                    slot.thread.start()
                self._cv.notify()
        return fut

    def cancel(self, fut: Future, kill: bool) -> bool:
        """Nobody waits for `fut` any more: drop it if pending (True); with `kill`, kill its
        child if it is running."""
        if fut.cancel():
            return True
        if kill:
            with self._cv:
                for s in self._slots:
                    if s.job is not None and s.job.future is fut:
                        s.kill(cancelled=True)
        return False

    def pending(self) -> int:
        return len(self._jobs)

    def pids(self) -> list[int]:
        """The live children (tests check that none is left behind)."""
        with self._cv:
            return [s.child.proc.pid for s in self._slots if s.child is not None and s.child.proc.poll() is None]

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            jobs, self._jobs = list(self._jobs), deque()
            for s in self._slots:
                s.kill(cancelled=True)
            self._cv.notify_all()
        for j in jobs:
            j.future.cancel()
        for s in self._slots:
            s.thread.join(10)

    def _next(self, slot: _Slot) -> _Job | None:
        with self._cv:
            slot.job = None
            while not self._closed:
                while self._jobs:
                    job = self._jobs.popleft()
                    if job.future.set_running_or_notify_cancel():
                        slot.job, slot.cancelled = job, False
                        return job
                self._cv.wait()
            child, slot.child = slot.child, None
        if child is not None:
            child.close()
        return None


class _Slot:
    """A thread that runs jobs, one at a time, in its own child process."""

    def __init__(self, pool: CompilePool) -> None:
        self.pool = pool
        self.child: _Child | None = None  # set and cleared by this slot's thread, under the pool's lock
        self.job: _Job | None = None
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, name="tandem-grammar-compile", daemon=True)

    def kill(self, cancelled: bool) -> None:
        """Under the pool's lock: kill the child; the slot's thread reads its pipe's end."""
        self.cancelled = self.cancelled or cancelled
        if self.child is not None:
            self.child.proc.kill()

    def _run(self) -> None:
        while (job := self.pool._next(self)) is not None:
            try:
                job.future.set_result(self._compile(job.key))
            except BaseException as exc:  # noqa: BLE001 - the job's waiter gets it
                job.future.set_exception(exc)

    def _compile(self, key: Key) -> tuple[Any, int]:
        limits = self.pool.limits
        child = self._child()
        try:
            child.jobs.send_bytes(json.dumps(key).encode())
            if not child.results.poll(limits.timeout):
                self._drop(child)
                raise CompileTimeout(f"compiling the {key[0]} took longer than {limits.timeout:g} s")
            header = json.loads(child.results.recv_bytes())
            if "error" in header:
                raise GrammarError(header["error"])
            data = child.results.recv_bytes().decode()
        except (EOFError, OSError):
            code = self._drop(child)
            if self.cancelled:
                raise GrammarError(f"the {key[0]} compile was cancelled") from None
            raise GrammarError(f"compiling the {key[0]} ended its process (exit status {code})") from None
        return self.pool.backend().deserialize(data), int(header["size"])

    def _drop(self, child: _Child) -> int:
        """Kill and reap the child; the next job starts a fresh one."""
        with self.pool._cv:
            self.child = None
        child.close()
        return child.proc.returncode

    def _child(self) -> _Child:
        if self.child is not None and self.child.proc.poll() is None:
            return self.child
        if self.child is not None:
            self._drop(self.child)
        spec = self.pool.backend().spec()
        child = _Child()
        with self.pool._cv:
            closed = self.pool._closed
            if not closed:
                self.child = child  # from here shutdown can kill it, also while it starts
        try:
            if closed:
                raise EOFError("the pool is shut down")
            child.handshake(self.pool.backend_name, spec, self.pool.limits)
        except (EOFError, OSError) as exc:
            self._drop(child)
            raise RuntimeError(f"the grammar compile process did not start: {exc}") from exc
        return child
