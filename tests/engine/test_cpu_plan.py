"""The CPU plan over the flag sets of real CPU families, and the builds against their levels.

The plan is a pure function of a flag set, so every family is checked here whatever CPU
runs the suite. The builds this CPU executes are disassembled: a capped build must hold
no instruction above its level (or a CPU of that level would fault), and each level's
own form must really be compiled in.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tandem.engine.kernels import cpu_build, cpu_kernels, cpu_plan
from tandem.engine.kernels.cpu_plan import OPS, REQUIRES, plan_for

V3 = REQUIRES["avx2"] | {"sse4_2", "popcnt"}
V4 = REQUIRES["avx512"] | V3
FAMILIES = {
    # name: (flags, level, packed bf16 linears, native bf16)
    "x86-64 baseline": (frozenset({"sse", "sse2"}), "generic", False, False),
    "AMD Zen 3 (AVX2)": (V3, "avx2", False, False),
    "Intel Haswell (AVX2)": (V3, "avx2", False, False),
    "Intel Sierra Forest (AVX2 + NE-CONVERT)": (V3 | {"avx_ne_convert"}, "avx2", True, False),
    "Knights Landing (AVX512F, no BW/VL)": (V3 | {"avx512f", "avx512cd"}, "avx2", False, False),
    "Intel Ice Lake (AVX-512)": (V4 | {"avx512_vnni"}, "avx512", True, False),
    "AMD Zen 4 (AVX-512 + BF16)": (V4 | {"avx512_bf16"}, "avx512_bf16", True, True),
    "Intel Sapphire Rapids (AMX)": (V4 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, "amx", True, True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_per_cpu_family(family: str) -> None:
    flags, level, packed, native = FAMILIES[family]
    plan = plan_for(flags, machine="x86_64")
    assert (plan.level, plan.pack_bf16_linears, plan.native_bf16) == (level, packed, native)
    assert plan.amx_extend == (level == "amx")
    assert plan.ops <= set(OPS)
    line = plan.describe()
    assert "\n" not in line and level in line and ("bfloat16" if native else "float32") in line


def test_other_architectures_get_the_generic_form() -> None:
    plan = plan_for(frozenset({"fp", "asimd", "sve"}), machine="aarch64")
    assert plan.level == "generic" and not plan.pack_bf16_linears
    assert cpu_plan.levels_supported(frozenset(), machine="aarch64") == ("generic",)


@pytest.mark.parametrize("cap,level", [("amx", "avx512_bf16"), ("avx512", "avx512"), ("avx2", "avx2"),
                                       ("generic", "generic")])
def test_cap_makes_a_big_cpu_decide_as_a_small_one(cap: str, level: str) -> None:
    """Zen 4 flags capped: the plan is the smaller CPU's (a cap above the CPU changes nothing)."""
    zen4 = FAMILIES["AMD Zen 4 (AVX-512 + BF16)"][0] | {"avx_ne_convert"}
    plan = plan_for(zen4, machine="x86_64", cap=cap)
    assert plan.level == level
    small = cap in ("avx2", "generic")
    assert plan.pack_bf16_linears != small and plan.native_bf16 == (level == "avx512_bf16")
    assert f"capped at {cap}" in plan.describe()


def test_bad_cap_and_disabled_kernels() -> None:
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA"):
        plan_for(V3, cap="avx1024")
    plan = plan_for(V4, machine="x86_64", kernels=False)
    assert plan.level is None and plan.ops == frozenset() and "kernels off" in plan.describe()


def test_env_decides_the_process_plan(plan_env) -> None:
    plan_env(TANDEM_CPU_ISA="generic")
    assert cpu_plan.current().level == "generic" and not cpu_plan.current().pack_bf16_linears
    plan_env(TANDEM_DISABLE_CPU_KERNELS="1")
    assert cpu_plan.current().level is None
    assert not cpu_kernels.available() and "TANDEM_DISABLE_CPU_KERNELS" in cpu_kernels.unavailable_reason()
    assert not any(cpu_kernels.enabled(op) for op in OPS)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_choices_follow_the_plan(monkeypatch, family: str) -> None:
    """Packing, dtype=auto and each op's kernel switch read the plan (this CPU's kernels
    stand in for the family's: the choice, not the build, is under test)."""
    from tandem.engine.models.layers import can_pack_linears
    from tandem.engine.runner.model_runner import resolve_dtype

    flags, level, packed, native = FAMILIES[family]
    plan = plan_for(flags, machine="x86_64")
    real = cpu_plan.current()
    monkeypatch.setattr(cpu_plan, "_current", [dataclasses.replace(plan, level=real.level)])
    cpu = torch.device("cpu")
    assert can_pack_linears(cpu, torch.bfloat16) == (packed and torch.backends.mkldnn.is_available())
    assert can_pack_linears(cpu, torch.float32) == torch.backends.mkldnn.is_available()  # any CPU oneDNN runs on
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native and torch.backends.mkldnn.is_available()
                                          else torch.float32)
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16  # allowed everywhere, warned where slow
    if real.level is not None and cpu_kernels.available():
        for op in OPS:
            assert cpu_kernels.enabled(op) == (op in plan.ops)


def test_this_cpu_plan_is_consistent() -> None:
    flags = cpu_plan.read_cpu_flags()
    plan = cpu_plan.current()
    supported = cpu_plan.levels_supported(flags)
    assert plan.level is None or plan.level in supported
    if "TANDEM_CPU_ISA" not in os.environ:
        assert plan.pack_bf16_linears == ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags)
        assert plan.native_bf16 == bool({"avx512_bf16", "amx_bf16"} & flags)


# Registers and instructions a level must not hold (a CPU of that level faults on them),
# and one it must hold (its own form was compiled in).
_FORBIDDEN = {
    "generic": re.compile(r"%[yz]mm\d|:\s+v[a-z0-9]+\s"),  # no AVX register, no VEX-encoded instruction
    "avx2": re.compile(r"%zmm\d|%k[0-7]\b|\bvdpbf16ps\b"),
    "avx512": re.compile(r"\bvdpbf16ps\b|\bvcvtne2?ps2bf16\b|\btdpbf16ps\b"),
    "avx512_bf16": re.compile(r"\btdpbf16ps\b|\bldtilecfg\b"),
    "amx": None,
}
_REQUIRED = {"generic": None, "avx2": r"%ymm\d", "avx512": r"%zmm\d", "avx512_bf16": r"\bvdpbf16ps\b",
             "amx": r"\btdpbf16ps\b"}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_build_holds_only_its_levels_instructions(kernel_level: str) -> None:
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu_build.library_path(kernel_level))],
                         capture_output=True, text=True, check=True).stdout
    forbidden, required = _FORBIDDEN[kernel_level], _REQUIRED[kernel_level]
    if forbidden is not None:
        bad = [ln for ln in asm.splitlines() if forbidden.search(ln)]
        assert not bad, f"{len(bad)} instructions above {kernel_level}, e.g. {bad[:3]}"
    if required is not None:
        assert re.search(required, asm), f"the {kernel_level} build holds no {required}"


def test_a_builder_killed_mid_build_never_blocks_a_later_start(tmp_path) -> None:
    """A worker killed while building leaves torch's lock file behind; a later start with a
    finished build loads it without waiting on that lock (it used to wait forever)."""
    level = cpu_plan.current().level  # the build every engine here loads: already there
    cpu_build.load(level)
    src = cpu_build.build_dir(level)
    home = tmp_path / "home"
    dst = home / "torch_extensions" / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.flock"))
    (dst / "lock").write_text("")  # a dead builder's
    code = f"from tandem.engine.kernels import cpu_build; print(cpu_build.load({level!r}))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TANDEM_HOME": str(home)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == cpu_build.namespace(level)
