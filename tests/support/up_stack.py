"""`tandem up` as a test drives it: the stack on free ports in its own run directory, its
processes found from /proc, and its stop that leaves nothing behind even when a test fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
from waits import wait_until
from worker_process import PROCESS_FILES, free_port

SMALL = "--max-total-tokens 16384"


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc (the workers run in their own sessions)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Stack:
    def __init__(self, model: Path, *flags: str, name: str = "tiny") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = Path(tempfile.mkdtemp(prefix="tandem-up-test-", dir=os.environ.get(PROCESS_FILES)))
        self.log = open(self.run_dir / "up.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--model", str(model), "--served-model-name", name,
             "--port", str(self.port), "--run-dir", str(self.run_dir), "--worker-args", SMALL, *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.tree: set[int] = set()

    def output(self) -> str:
        self.log.flush()
        return (self.run_dir / "up.log").read_text(errors="replace")[-8000:]

    def wait_up(self, timeout: float = 240) -> Stack:
        def up() -> bool:
            assert self.proc.poll() is None, self.output()
            try:
                # The router answers /health only once every worker is ready; the banner follows.
                return (httpx.get(self.url + "/health", timeout=2).status_code == 200
                        and "Tandem is up" in self.output())
            except httpx.HTTPError:
                return False

        wait_until(up, timeout, f"tandem up serving:\n{self.output()}", interval=0.3)
        self.tree = _children(self.proc.pid)
        return self

    def state(self) -> dict:
        return json.loads((self.run_dir / "stack.json").read_text())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in self.tree:  # a failed test must not leave workers behind either
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def assert_gone(self) -> None:
        left = [pid for pid in self.tree if _alive(pid)]
        assert not left, f"processes left behind: {left}\n{self.output()}"
        with socket.socket() as s:
            # Free again for a new listener (connections in TIME_WAIT don't block one, as for uvicorn).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))


def _pools_whole(stack: Stack) -> None:
    for name, info in stack.state().items():
        if name != "router":
            state = httpx.get(info["url"] + "/debug/pool", timeout=30).json()
            assert state["whole"] in (True, None), (name, state)
