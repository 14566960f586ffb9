"""The scheduler process's heap policy (engine/heap.py): after tune(), a block of megabytes is
served from the heap rather than a fresh mmap that every op would fault in again; glibc's own
tunable in the environment wins. Each case runs in a subprocess: the policy is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, json
from tandem.engine import heap

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2

def mmapped_while_held(nbytes):
    p = libc.malloc(nbytes)
    held = libc.mallinfo2().hblks
    libc.free(p)
    return held - libc.mallinfo2().hblks

# Before: 8 MiB is above glibc's starting threshold. Its free raises the dynamic threshold to
# 8 MiB, so the block after tuning is a larger one, which glibc alone would still mmap.
before = mmapped_while_held(8 << 20)
tuned = heap.tune()
after = mmapped_while_held(16 << 20)
heap.trim()
print(json.dumps({"before": before, "tuned": tuned, "after": after}))
"""


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _glibc_only():
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if not libc or not hasattr(ctypes.CDLL(libc), "mallinfo2"):
        pytest.skip("glibc >= 2.33 (mallinfo2) only")


def test_tuned_heap_serves_megabyte_blocks_without_mmap():
    got = _probe({"MALLOC_MMAP_THRESHOLD_": None})
    assert got == {"before": 1, "tuned": True, "after": 0}


def test_the_environment_tunable_wins():
    got = _probe({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert got["tuned"] is False
    assert got["after"] == 1  # the operator's 1 MiB threshold still holds
