"""Check that staged wheels install on the GPU machine by themselves: every Requires-Dist of
every wheel (extras aside, markers evaluated for CPython 3.12 on x86-64 Linux) is met by another
staged wheel, at a version its specifier allows, or by a package the machine already has
(bench/gpu_image_packages.txt; versions unknown there, so any version is taken to do), and no
package is staged twice (`pip install --no-deps` of two versions of one stops the whole install).

    python bench/wheel_needs.py .whl --present bench/gpu_image_packages.txt

Prints what each wheel needs and where it comes from; exits 1 on anything unmet.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# The GPU machine: python3 3.12.3 on x86-64 Linux (KINDS.md).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


@dataclass(frozen=True)
class Wheel:
    name: str  # canonical
    version: Version
    requires: tuple[Requirement, ...]  # those that apply on the target, extras left out
    file: str


def read_wheel(path: Path) -> Wheel:
    with zipfile.ZipFile(path) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    reqs = tuple(r for r in map(Requirement, meta.get_all("Requires-Dist") or [])
                 if r.marker is None or r.marker.evaluate(TARGET))
    return Wheel(canonicalize_name(meta["Name"]), Version(meta["Version"]), reqs, path.name)


def read_present(path: Path) -> set[str]:
    words = (w for line in path.read_text().splitlines() if not line.startswith("#") for w in line.split())
    return {canonicalize_name(w) for w in words}


def problems(wheels: list[Wheel], present: set[str]) -> tuple[list[str], list[str]]:
    """(report lines, problems): each requirement and what meets it; what nothing meets."""
    staged: dict[str, Wheel] = {}
    bad, lines = [], []
    for w in wheels:
        if w.name in staged:
            bad.append(f"{w.name} staged twice: {staged[w.name].file} and {w.file}")
        staged[w.name] = w
    for w in wheels:
        for req in w.requires:
            name = canonicalize_name(req.name)
            if name in staged:
                ok = req.specifier.contains(staged[name].version, prereleases=True)
                where = f"staged {staged[name].version}" + ("" if ok else f", NOT {req.specifier}")
                if not ok:
                    bad.append(f"{w.name} needs {req}, staged is {staged[name].version}")
            elif name in present:
                where = "on the machine (version unchecked)"
            else:
                where = "MISSING"
                bad.append(f"{w.name} needs {req}: neither staged nor on the machine")
            lines.append(f"{w.name} {w.version}: {req} -> {where}")
    return lines, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", type=Path, help="the folder of staged wheels")
    ap.add_argument("--present", type=Path, required=True, help="names of the packages the machine has")
    args = ap.parse_args()
    wheels = [read_wheel(p) for p in sorted(args.wheels.glob("*.whl"))]
    lines, bad = problems(wheels, read_present(args.present))
    print("\n".join(lines))
    for line in bad:
        print(f"UNMET: {line}", file=sys.stderr)
    print(f"{len(wheels)} wheels, {len(lines)} requirements, {len(bad)} unmet")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
