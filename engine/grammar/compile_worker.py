"""The grammar compile process: `python -m tandem.engine.grammar.compile_worker JOBS RESULTS`.

A compile cannot be interrupted once xgrammar has started it, so it runs here, in a child
that compile_pool.py kills at its deadline. The child rebuilds a compile-only backend from
the parent's spec once, then answers one job at a time: a header (JSON), and for a grammar
that compiled, its serialized text as a second message.

Whatever a grammar costs is checked here, before the parent pays for it: its size (memory
and the serialized text the parent must read back), and its first vocabulary mask, timed in
this process's CPU: a grammar slow from its first token is refused before any scheduler runs
it (the matcher budget, matcher_budget.py, catches one that only slows down later).

Its address space is capped (`bound_memory`) at what it holds once the backend is built plus
a headroom: a schema whose compile or text would take gigabytes (1,000 optional properties
reached 5 GB here) fails with a MemoryError, or ends the child, instead of pressing the pod
toward its memory limit, where the OOM killer might pick the worker itself.

The child ends when the parent does: a thread reads the job pipe, and its end of file (the
parent gone, whatever the reason) exits the process even in the middle of a compile.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from tandem.engine.grammar.backend import GrammarBackend, GrammarError
from tandem.engine.grammar.registry import create_from_spec

TEXT_RATIO = 4


def compile_one(backend: GrammarBackend, kind: str, text: str, max_bytes: int,
                probe_limit: float) -> tuple[dict[str, Any], str | None]:
    """(header, serialized grammar or None): the header holds "error" or "size"."""
    try:
        compiled = backend.compile(kind, text)
    except GrammarError as exc:
        return {"error": str(exc)}, None
    except Exception as exc:  # noqa: BLE001 - the parent turns it into the request's error
        return {"error": f"could not compile the {kind}: {exc}"}, None
    size = backend.size_bytes(compiled)
    if size > max_bytes:
        return {"error": f"the compiled {kind} would take {_mib(size)}, more than the {_mib(max_bytes)} "
                         "a grammar may hold"}, None
    mask = backend.allocate_mask(1)
    t0 = time.thread_time()
    backend.matcher(compiled).fill_mask(mask, 0)
    cost = time.thread_time() - t0
    if cost > probe_limit:
        return {"error": f"the {kind} is too costly to follow: its first vocabulary mask took {cost:.2f} s "
                         f"of CPU (the limit is {probe_limit:g} s)"}, None
    try:
        data = backend.serialize(compiled)
    except (MemoryError, RuntimeError) as exc:  # RuntimeError: xgrammar's std::bad_alloc at the cap
        return {"error": f"the compiled {kind} is too large to hand back ({_first_line(exc)})"}, None
    # xgrammar's text for a schema's optional properties grows with their count squared (300:
    # 0.9 MiB in memory, 31 MiB as text): the text may be TEXT_RATIO times the memory bound.
    if len(data) > TEXT_RATIO * max_bytes:
        return {"error": f"the compiled {kind} is {_mib(len(data))} serialized, more than the "
                         f"{_mib(TEXT_RATIO * max_bytes)} a grammar may hold"}, None
    return {"size": size}, data


def headroom(max_bytes: int) -> int:
    """Address space a compile may add: the grammar, its text (TEXT_RATIO times), xgrammar's work."""
    return 2**30 + 4 * TEXT_RATIO * max_bytes


def bound_memory(extra: int) -> None:
    """Cap this process's address space at its present size plus `extra` bytes."""
    import resource

    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, resource.RLIM_INFINITY))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _read_jobs(conn: Connection, jobs: queue.SimpleQueue) -> None:
    try:
        while True:
            jobs.put(conn.recv_bytes())
    except (EOFError, OSError):
        os._exit(0)  # the parent is gone (or let go of us): stop now, even mid-compile


def main(argv: list[str]) -> None:
    conn_in = Connection(int(argv[0]), writable=False)
    conn_out = Connection(int(argv[1]), readable=False)
    setup = json.loads(conn_in.recv_bytes())
    backend = create_from_spec(setup["backend"], setup["spec"])
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_jobs, args=(conn_in, jobs), daemon=True).start()
    if sys.platform == "linux":
        bound_memory(headroom(setup["max_bytes"]))
    conn_out.send_bytes(b'{"ready": true}')
    while True:
        kind, text = json.loads(jobs.get())
        header, data = compile_one(backend, kind, text, setup["max_bytes"], setup["probe_limit"])
        conn_out.send_bytes(json.dumps(header).encode())
        if data is not None:
            conn_out.send_bytes(data.encode())


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (EOFError, BrokenPipeError):
        pass  # the parent went away
