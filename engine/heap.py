"""The scheduler process's heap: glibc malloc tuned for a server whose activations are
megabytes that change shape every step.

glibc serves a block above its mmap threshold from a fresh mmap and unmaps it on free, so each
such tensor is page-faulted in (and zeroed by the kernel) on its first touch, every time. A
forward allocates one or more outputs per op: with smollm2 at 35-256 prompt tokens, a
64 KiB threshold made `tandem serve`'s prefill 1.24-1.44x slower than this tuning on a 2-core
VM, where a fault costs microseconds (docs/benchmarks.md, "The scheduler's heap"). glibc's own
dynamic threshold only rises after a block of each size has been freed once, so new shapes pay
again (1.19x slower), and it fragmented the heap under a long mixed load.

`tune()` fixes the mmap threshold at glibc's maximum (32 MiB: a 2,048-token chunk's
activations of a small model stay on the heap) and raises the trim threshold so a free at the
heap's top does not hand pages back that the next step faults in again. What the heap then
holds beyond its live blocks goes back to the OS when the scheduler goes idle, and at most
every TRIM_PERIOD seconds under load (`trim`, from the scheduler): a load that never pauses
would otherwise keep what fragmentation strands. MALLOC_MMAP_THRESHOLD_ in the environment
(glibc's own tunable) means the operator chose: nothing is changed. Off glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

MMAP_THRESHOLD = 32 << 20  # glibc refuses larger (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 512 << 20
TRIM_PERIOD = 10.0  # seconds; a trim makes the next steps fault their blocks in again
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

_libc: ctypes.CDLL | None = None  # set once tune() has changed this process's heap
_last_trim = 0.0


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both exist only in glibc)
    except (OSError, AttributeError):
        return None
    return libc


def tune() -> bool:
    """Fix the thresholds for this process; True when they were set."""
    global _libc
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return False
    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _libc = libc
    return True


def trim(min_interval: float = 0.0) -> None:
    """Return the heap's free pages to the OS, unless the last trim was under `min_interval`
    seconds ago (a process tune() changed; else nothing)."""
    global _last_trim
    if _libc is None:
        return
    now = time.monotonic()
    if now - _last_trim >= min_interval:
        _last_trim = now
        _libc.malloc_trim(0)
