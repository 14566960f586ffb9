"""What the running CPU can do, and which CPU path each part of the engine takes there.

Decided once per process from the CPU's feature flags (/proc/cpuinfo) and logged in one
line (`current()`); `plan_for()` is the same decision as a pure function of a flag set,
so tests run it over the flag sets of CPUs this machine is not (tests/engine/test_cpu_plan.py).

    kernel level   the highest csrc/ build the CPU executes (cpu_build.py):
                   generic < avx2 < avx512 < avx512_bf16 < amx
    kernel ops     which ops of that build run; an op whose form measured slower than
                   torch's own path on a level stays on torch there (_TORCH_FASTER)
    packed linears oneDNN's bf16 weight packing: its reorder needs AVX512 BW+VL+DQ or
                   AVX-NE-CONVERT, and raises on any other CPU
    auto dtype     bfloat16 only with native bf16 arithmetic (AVX512-BF16 or AMX); an
                   explicit bfloat16 elsewhere runs torch's emulated bf16 matmul: exact
                   to bf16, several times slower than float32

TANDEM_CPU_ISA=<level> caps the level and hides the flags above it, so a big CPU makes
every decision a smaller one would (with ATEN_CPU_CAPABILITY=avx2 and
ONEDNN_MAX_CPU_ISA=AVX2, torch's own kernels follow). TANDEM_DISABLE_CPU_KERNELS=1
keeps every op on torch. torch-free: only the flags are read here.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
OPS = ("decode_attention", "extend_attention", "layer_ops", "store_kv", "sampling", "experts", "stream_linears")

_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})  # x86-64-v3 (abm = LZCNT)
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
REQUIRES = {
    "generic": frozenset(),
    "avx2": _V3,
    "avx512": _V4,
    "avx512_bf16": _V4 | {"avx512_bf16"},
    "amx": _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
}
# Ops whose kernel form measured slower than torch's path at that level
# (bench/cpu_forms.py, docs/benchmarks.md "CPU kernel forms"): torch runs them there.
# The plain-lane form is a portability floor, 0.03-0.6x torch's own vectorised attention
# and elementwise ops, 0.03-0.25x torch's grouped matmul for MoE experts (bench/moe_block_cpu.py
# under TANDEM_CPU_ISA=generic); its sampling still wins (~3x: no sort, no ten vocab-sized tensors).
_TORCH_FASTER: dict[str, frozenset[str]] = {
    "generic": frozenset({"decode_attention", "extend_attention", "layer_ops", "experts", "stream_linears"}),
    "avx2": frozenset(),
    "avx512": frozenset(),
    "avx512_bf16": frozenset(),
    "amx": frozenset(),
}
_ONEDNN_BF16 = frozenset({"avx512bw", "avx512vl", "avx512dq"})


@dataclass(frozen=True)
class CpuPlan:
    level: str | None  # the kernel build, None: every op on torch
    ops: frozenset[str]  # ops that run the kernels
    pack_bf16_linears: bool  # oneDNN-packed bf16 weights
    native_bf16: bool  # dtype="auto" picks bfloat16
    why: str  # the CPU facts behind the choices, for the log line

    @property
    def amx_extend(self) -> bool:  # bf16 extend attention on AMX tiles
        return self.level == "amx"

    def describe(self) -> str:
        if self.level is None:
            kernels = "kernels off"
        else:
            torch_ops = sorted(set(OPS) - self.ops)
            kernels = f"kernels {self.level} for {', '.join(sorted(self.ops)) or 'no op'}"
            if torch_ops:
                kernels += f", torch for {', '.join(torch_ops)}"
        return (
            f"CPU plan: {kernels}; AMX extend {'on' if self.amx_extend else 'off'}; "
            f"bf16 linears {'packed' if self.pack_bf16_linears else 'unpacked'}; "
            f"dtype=auto -> {'bfloat16' if self.native_bf16 else 'float32'} ({self.why})"
        )


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


@functools.cache
def read_cpu_flags() -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo (empty where there is none); read once."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def levels_supported(flags: frozenset[str], machine: str | None = None) -> tuple[str, ...]:
    """Every level whose instructions this CPU executes, lowest first."""
    if not is_x86(machine):
        return ("generic",)
    return tuple(lv for lv in LEVELS if REQUIRES[lv] <= flags)


def runnable_levels() -> tuple[str, ...]:
    """The levels this process may run: the CPU's, under the TANDEM_CPU_ISA cap."""
    cap = os.environ.get("TANDEM_CPU_ISA") or None
    flags = read_cpu_flags()
    return levels_supported(cap_flags(flags, cap) if cap in LEVELS else flags)


def cap_flags(flags: frozenset[str], cap: str) -> frozenset[str]:
    """The flags a CPU of level `cap` would show: everything the levels above it add is hidden
    (AVX-NE-CONVERT with AVX-512, as a common AVX2 CPU lacks both)."""
    above = set().union(*(REQUIRES[lv] for lv in LEVELS[LEVELS.index(cap) + 1 :])) - REQUIRES[cap]
    if LEVELS.index(cap) < LEVELS.index("avx512"):
        above.add("avx_ne_convert")
    return frozenset(flags - above)


def plan_for(
    flags: frozenset[str], machine: str | None = None, cap: str | None = None, kernels: bool = True
) -> CpuPlan:
    """The decisions for a CPU with these flags (pure: tests pass fake flag sets)."""
    if cap is not None:
        if cap not in LEVELS:
            raise ValueError(f"TANDEM_CPU_ISA={cap!r}: expected one of {', '.join(LEVELS)}")
        flags = cap_flags(flags, cap)
    supported = levels_supported(flags, machine)
    level = supported[-1] if kernels else None
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    pack = _ONEDNN_BF16 <= flags or "avx_ne_convert" in flags
    facts = [f"CPU level {supported[-1]}" + (f" (capped at {cap})" if cap else "")]
    facts.append("native bf16" if native_bf16 else "no AVX512-BF16/AMX")
    if not pack:
        facts.append("oneDNN bf16 packing needs AVX512 BW/VL/DQ or AVX-NE-CONVERT")
    if not kernels:
        facts.append("TANDEM_DISABLE_CPU_KERNELS set")
    return CpuPlan(
        level=level,
        ops=frozenset(OPS) - _TORCH_FASTER[level] if level else frozenset(),
        pack_bf16_linears=pack,
        native_bf16=native_bf16,
        why="; ".join(facts),
    )


_lock = threading.Lock()
_current: list[CpuPlan] = []


def current() -> CpuPlan:
    """This process's plan: from the real flags and the env caps, decided and logged once."""
    if not _current:
        with _lock:
            if not _current:
                disabled = os.environ.get("TANDEM_DISABLE_CPU_KERNELS", "") not in ("", "0")
                cap = os.environ.get("TANDEM_CPU_ISA") or None
                plan = plan_for(read_cpu_flags(), cap=cap, kernels=not disabled)
                log.info("%s", plan.describe())
                _current.append(plan)
    return _current[0]


def reset() -> None:
    """Forget the decision (tests that change the env)."""
    with _lock:
        _current.clear()
