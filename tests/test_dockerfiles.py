"""The runtime image can run the GPU path: read from docker/Dockerfile.runtime, no container built.

FlashInfer 0.7 JIT-compiles its paged kernels with nvcc on first use, so the base must be a
CUDA -devel image (or the image must ship FlashInfer's AOT kernels); FlashInfer is pinned,
since its wrapper API changes between versions; and every CUDA-built wheel (torch, NIXL) is
built for the base's CUDA major. The extras a `pip install ".[...]"` names count with what
pyproject.toml puts in them.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "docker" / "Dockerfile.runtime"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


def base_image(text: str) -> str:
    """The FROM image, with an `ARG NAME=default` it names substituted."""
    args = dict(a.split("=", 1) for op, a in instructions(text) if op == "ARG" and "=" in a)
    image = next(a for op, a in instructions(text) if op == "FROM").split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image)


def extra_requirements(extras: list[str], table: dict[str, list[str]]) -> list[str]:
    """The requirements of pyproject extras, `tandem[x]` references followed."""
    out: list[str] = []
    for extra in extras:
        for req in table[extra]:
            ref = re.fullmatch(r"tandem\[([\w,-]+)\]", req)
            out += extra_requirements(ref.group(1).split(","), table) if ref else [req]
    return out


def pip_requirements(text: str) -> list[str]:
    """Every requirement a `pip install` in the Dockerfile installs, extras of the project expanded."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs: list[str] = []
    for op, arg in instructions(text):
        for cmd in re.split(r"&&|;", arg) if op == "RUN" else []:
            words = shlex.split(cmd)
            if words[:2] != ["pip", "install"]:
                continue
            for word in (w for w in words[2:] if not w.startswith("-") and "://" not in w):
                local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word)
                reqs += extra_requirements(local.group(1).split(","), table) if local and local.group(1) else (
                    [] if local else [word])
    return reqs


def cuda_major(text: str) -> int:
    return int(re.match(r"nvidia/cuda:(\d+)\.", base_image(text)).group(1))


def test_the_base_can_compile_flashinfer_kernels() -> None:
    text = RUNTIME.read_text()
    ships_aot = any(re.match(r"flashinfer-(jit-cache|cubin)==", r) for r in pip_requirements(text))
    assert "-devel" in base_image(text) or ships_aot, f"{base_image(text)} has no nvcc for FlashInfer's JIT"
    arch = next((a for op, a in instructions(text) if op == "ENV" and "FLASHINFER_CUDA_ARCH_LIST" in a), "")
    assert "9.0a" in arch, "FLASHINFER_CUDA_ARCH_LIST must name Hopper's sm_90a"


def test_flashinfer_is_pinned() -> None:
    flashinfer = [r for r in pip_requirements(RUNTIME.read_text()) if r.startswith("flashinfer")]
    assert flashinfer and all(re.fullmatch(r"flashinfer-[\w-]+==[\w.]+", r) for r in flashinfer), flashinfer


def test_cuda_wheels_match_the_base_cuda_major() -> None:
    text = RUNTIME.read_text()
    major = cuda_major(text)
    torch_index = next(a for op, a in instructions(text) if op == "ARG" and a.startswith("TORCH_INDEX="))
    assert re.search(rf"/cu{major}\d$", torch_index), torch_index
    nixl = [r for r in pip_requirements(text) if r.startswith("nixl")]
    assert nixl, "the image runs PD workers: it needs NIXL"
    pinned = [r for r in nixl if re.fullmatch(rf"nixl-cu{major}==[\w.]+", r)]
    assert pinned == nixl, f"NIXL must be pinned and built for CUDA {major}: {nixl}"


def test_the_parsers_read_what_the_old_image_got_wrong() -> None:
    """The checks above on the image this replaced: a runtime base, extras that bring an
    unpinned FlashInfer and the CUDA 12 NIXL."""
    old = ('ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04\nFROM ${CUDA_IMAGE}\n'
           'RUN pip install "torch==2.6.0" --index-url "${TORCH_INDEX}"\n'
           'RUN pip install ".[pd,router,gpu]" \\\n && rm -rf /src\n')
    assert base_image(old) == "nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04"
    reqs = pip_requirements(old)
    assert "flashinfer-python" in reqs and "nixl-cu12" in reqs and "torch==2.6.0" in reqs
