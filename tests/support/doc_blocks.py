"""The docs' code blocks, read as a reader pastes them, and run the same way.

A fenced ```bash / ```sh / ```console / ```python block in README.md or docs/*.md is run as
written unless an HTML comment on the line just above it says otherwise:

    <!-- doc-test: skip — why it is not run here -->     not run; the reason is required
    <!-- doc-test: needs tandem-up-tiny -->              run against `tandem up` on the tiny model
    <!-- doc-test: serves PORT -->                       it starts servers in the background; it
                                                          passes once 127.0.0.1:PORT answers a chat
                                                          completion

A block runs in bash (python blocks in python) in its own session, with a marker in its
environment that every process it starts inherits: stopping the block stops each of them,
those that left its session (`tandem up` starts its workers in their own) included.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from waits import wait_until

LANGS = ("bash", "sh", "console", "python")
MARKER = "TANDEM_DOC_BLOCK"
SKIP, NEEDS, SERVES = "skip", "needs", "serves"
STACKS = ("tandem-up-tiny",)
_FENCE = re.compile(r"^```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
# `--port N` binds N and (the default admin listener) N + 1 or, for the router, N + 2.
_PORT_FLAG = re.compile(r"--(port|bootstrap-port|admin-port)[ =](\d+)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directive: str | None  # what the comment above says, after "doc-test:"

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def kind(self) -> str | None:
        return self.directive.split(maxsplit=1)[0] if self.directive else None

    @property
    def argument(self) -> str:
        """What follows the directive's first word: a skip's reason, a stack's or a port's name."""
        rest = self.directive.split(maxsplit=1)[1] if self.directive and " " in self.directive else ""
        return rest.lstrip("—–-: ").strip()

    def problem(self) -> str | None:
        """Why this block's annotation is unusable, or None."""
        if self.directive is None:
            return None
        if self.kind == SKIP:
            return None if len(self.argument) >= 8 else "a skip must say why the block is not run here"
        if self.kind == NEEDS:
            return None if self.argument in STACKS else f"needs names one of {STACKS}"
        if self.kind == SERVES:
            return None if self.argument.isdigit() else "serves names the port the block's server answers on"
        return f"unknown doc-test directive {self.directive!r} (skip, needs, serves)"

    def script(self) -> str:
        """The text a reader pastes: a console block's `$ ` lines, without their prompts."""
        if self.lang != "console":
            return self.text
        return "\n".join(line[2:] for line in self.text.splitlines() if line.startswith("$ "))

    def ports(self) -> set[int]:
        """The fixed local ports the block listens on, its servers' default admin listeners included."""
        found = set()
        for flag, port in _PORT_FLAG.findall(self.text):
            found |= {int(port), int(port) + 1, int(port) + 2} if flag == "port" else {int(port)}
        return found


def blocks(path: Path) -> list[Block]:
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        if m.group(1) in LANGS:
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            d = _DIRECTIVE.match(above)
            out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", d.group(1) if d else None))
        i = end + 1
    return out


@dataclass
class Run:
    proc: subprocess.Popen
    marker: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@contextmanager
def started(block: Block, cwd: Path, env: dict[str, str] | None = None) -> Iterator[Run]:
    """The block running in `cwd`; every process it started is stopped on the way out."""
    marker = uuid.uuid4().hex
    if block.lang == "python":
        (cwd / "block.py").write_text(block.text)
        argv = [sys.executable, "block.py"]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.script()]
    # The venv's python and console scripts first, as in a shell where it is activated.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    log = cwd / f"block-{block.line}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                env={**os.environ, "PATH": path, **(env or {}), MARKER: marker})
    try:
        yield Run(proc, marker, log)
    finally:
        left = stop(marker)
        proc.wait()
        if left:
            raise AssertionError(f"{block.id}: processes outlived SIGKILL: {sorted(left)}")


def marked(marker: str) -> set[int]:
    """Live processes whose environment carries `marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:  # gone, or not ours
                continue
    return found


def stop(marker: str, grace: float = 60) -> set[int]:
    """SIGTERM every marked process (servers drain and exit), then SIGKILL what is left; what
    outlived both (nothing, normally)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            wait_until(lambda: not marked(marker), grace, "the block's processes exited", interval=0.2)
            return set()
        except AssertionError:
            continue
    return marked(marker)
