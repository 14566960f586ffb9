"""The wheels staged for the GPU machine (bench/stage_wheels.sh): the pinned list, and the check
that every staged wheel's Requires-Dist is met there (bench/wheel_needs.py), over fabricated
wheels (no network)."""

from __future__ import annotations

import importlib.util
import re
import sys
import zipfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
_spec = importlib.util.spec_from_file_location("wheel_needs", BENCH / "wheel_needs.py")
wheel_needs = importlib.util.module_from_spec(_spec)
sys.modules["wheel_needs"] = wheel_needs  # its dataclasses look their module up there
_spec.loader.exec_module(wheel_needs)


def fake_wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def check(folder: Path, present: set[str]) -> list[str]:
    wheels = [wheel_needs.read_wheel(p) for p in sorted(folder.glob("*.whl"))]
    return wheel_needs.problems(wheels, present)[1]


def test_met_by_a_staged_wheel_or_the_machine(tmp_path: Path) -> None:
    fake_wheel(tmp_path, "fastapi", "1.0", "starlette>=1", "anyio>=4", 'uvloop; extra == "standard"',
               'exceptiongroup; python_version < "3.11"')
    fake_wheel(tmp_path, "starlette", "1.2")
    assert check(tmp_path, {"anyio"}) == []  # extras and markers false on CPython 3.12 are not needed


def test_missing_wrong_version_and_twice_are_refused(tmp_path: Path) -> None:
    fake_wheel(tmp_path, "pydantic", "2.0", "pydantic-core==2.5", "annotated-types")
    fake_wheel(tmp_path, "pydantic_core", "2.4")
    bad = check(tmp_path, set())
    assert any("pydantic-core==2.5" in b and "2.4" in b for b in bad)
    assert any("annotated-types" in b and "neither staged nor on the machine" in b for b in bad)
    other = tmp_path / "twice"
    other.mkdir()
    fake_wheel(other, "h11", "0.14")
    fake_wheel(other, "H11", "0.16")
    assert any("staged twice" in b for b in check(other, set()))


def test_the_list_pins_each_package_once() -> None:
    lines = [ln.strip() for ln in (BENCH / "gpu_wheels.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", ln) for ln in lines), lines
    names = [ln.split("==")[0].lower().replace("_", "-") for ln in lines]
    assert len(names) == len(set(names))
    assert {"fastapi", "uvicorn", "pydantic", "pydantic-core", "xgrammar", "starlette"} <= set(names)
    present = wheel_needs.read_present(BENCH / "gpu_image_packages.txt")
    assert {"torch", "transformers", "triton", "h11", "anyio", "apache-tvm-ffi"} <= present
    assert not {"fastapi", "uvicorn", "pydantic", "xgrammar"} & present  # what the image lacks
