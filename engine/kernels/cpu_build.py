"""Builds the fused CPU kernels (csrc/) for one instruction-set level, on first use.

Each level is its own library, compiled from the same sources with that level's flags
and registering its ops as torch.ops.tandem_cpu_<level>.*, so several levels load side
by side in one process: the tests run every level this CPU can execute, and a level
above it is never built (its code would die on an illegal instruction).

    level        flags                                        vec16.h form
    generic      -march=x86-64 (none on other arches)         float[16] lanes, no intrinsics
    avx2         -march=x86-64-v3   (AVX2, FMA, F16C, BMI2)   2 x __m256
    avx512       -march=x86-64-v4   (AVX-512 F/BW/CD/DQ/VL)   __m512
    avx512_bf16  v4 + -mavx512bf16                            __m512, vdpbf16ps decode products
    amx          v4 + -mavx512bf16 -mamx-tile -mamx-bf16      __m512, AMX tile extend products

The flags name a level instead of -march=native, so a build matches what its level
promises (tests/engine/test_cpu_plan.py disassembles the capped builds to prove it). The
build lives in $TANDEM_HOME/torch_extensions/tandem_cpu_<level>-<key>; the key hashes
the sources, the flags, the torch version and the CPU's flags (for -mtune=native), so
an edited source gets a fresh build and an unchanged one loads in well under a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

from tandem.engine.kernels.cpu_plan import LEVELS, is_x86, read_cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention_cpu.cpp", "extend_attention_cpu.cpp", "layer_ops_cpu.cpp", "sampling_cpu.cpp",
           "expert_gemm_cpu.cpp", "panel_linear_cpu.cpp", "decode_layer_cpu.cpp")
_HEADERS = tuple(sorted(p.name for p in CSRC.glob("*.h")))  # all of them feed the build key
_LEVEL_FLAGS = {
    "generic": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mtune=native"],
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mtune=native"],
}
# hidden: each library keeps its own copies of shared inline code (the paged-argument
# checks, the dispatch) instead of the dynamic linker binding every library to the first
# one loaded, which would run one level's instructions inside another.
_COMMON = ["-O3", "-fopenmp", "-DNDEBUG", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
REGISTERED_OPS = ("paged_decode_attention", "paged_extend_attention", "rope_qk", "store_kv", "rms_norm",
                  "fused_add_rms_norm", "silu_and_mul", "gumbel_argmax", "greedy_argmax", "expert_gemm", "panel_linear",
                  "decode_layer")

_lock = threading.Lock()
BUILT = "built"  # written once the library is whole
_built: dict[str, str | BaseException] = {}  # level -> op namespace, or the build's error


def namespace(level: str) -> str:
    return f"tandem_cpu_{level}"


def compile_flags(level: str) -> list[str]:
    if level not in LEVELS:
        raise ValueError(f"unknown CPU kernel level {level!r}; one of {', '.join(LEVELS)}")
    arch = _LEVEL_FLAGS[level] if is_x86() else []  # generic elsewhere: the compiler's default target
    return [*_COMMON, *arch, f"-DTANDEM_OPS={namespace(level)}"]


def build_dir(level: str) -> Path:
    flags = compile_flags(level)
    texts = [(CSRC / f).read_bytes() for f in (*SOURCES, *_HEADERS)]
    key = hashlib.sha256(b"\0".join([
        *texts, " ".join(flags).encode(), torch.__version__.encode(), platform.machine().encode(),
        " ".join(sorted(read_cpu_flags())).encode(),
    ])).hexdigest()[:16]
    home = Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
    return home / "torch_extensions" / f"{namespace(level)}-{key}"


def _compile(level: str) -> str:
    out = build_dir(level)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # The build directory is named by everything that goes into the library, so a finished
    # build is loaded as it is. Builders take turns through an flock, which the kernel drops
    # when its holder dies; torch's own lock file would stay behind a worker killed mid-build
    # and make every later start wait on it forever.
    with open(out / "build.flock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        if (out / BUILT).exists():
            torch.ops.load_library(str(library_path(level)))
        else:
            _build(out, level)
            (out / BUILT).write_text(torch.__version__)
    ns = getattr(torch.ops, namespace(level))
    for op in REGISTERED_OPS:
        getattr(ns, op)  # raises if registration failed
    log.info("CPU kernels (%s) ready in %.1fs (%s)", level, time.perf_counter() - t0, out)
    return namespace(level)


def _build(out: Path, level: str) -> None:
    from torch.utils import cpp_extension

    (out / "lock").unlink(missing_ok=True)  # torch's lock file, left by a builder that died (we hold the turn)
    # is_python_module=False: the .so only registers ops with the dispatcher (no pybind11).
    cpp_extension.load(
        name=out.name.replace("-", "_"),
        sources=[str(CSRC / f) for f in SOURCES],
        extra_cflags=compile_flags(level),
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        is_python_module=False,
        verbose=False,
    )


def load(level: str) -> str:
    """The op namespace of `level`'s library, built on first use. Raises the build's error
    (every later call re-raises it without rebuilding). The caller checks that the CPU
    runs the level: cpu_plan.levels_supported()."""
    with _lock:
        if level not in _built:
            try:
                _built[level] = _compile(level)
            except Exception as e:  # remembered: a failed build is not retried per call
                _built[level] = e
        got = _built[level]
    if isinstance(got, BaseException):
        raise got
    return got


def library_path(level: str) -> Path:
    """The built shared library of `level` (after load())."""
    libs = sorted(build_dir(level).glob("*.so"))
    if not libs:
        raise FileNotFoundError(f"no built library for {level} in {build_dir(level)}")
    return libs[0]
