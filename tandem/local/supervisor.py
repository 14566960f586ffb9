"""Runs the planned components as child processes: start, readiness, death, shutdown.

Each child gets its own session, so a Ctrl-C at the terminal reaches only `tandem up`,
which then stops the stack in order: the router first (no new requests; its in-flight
streams finish), then the workers (each drains, then frees its pool), then SIGKILL to
the process group of anything still there. A child also gets SIGKILL from the kernel if
`tandem up` itself is killed (PR_SET_PDEATHSIG), so no path leaves orphans behind.

Every Popen runs on the main thread: PDEATHSIG follows the thread that forked.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.local.logs import LogSink
from tandem.local.plan import ROUTER, Component

WORKER_STOP_S = 45.0  # a worker's drain (30 s by default) plus its scheduler's exit
ROUTER_STOP_S = 15.0  # the router's graceful shutdown (10 s) plus margin
_PR_SET_PDEATHSIG = 1


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    def setup() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # not glibc: shutdown() still kills every process group
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


@dataclass
class Child:
    comp: Component
    proc: subprocess.Popen
    started: float
    restarts: int = 0

    def exit_text(self) -> str:
        rc = self.proc.returncode
        return f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"


class StackDown(Exception):
    """A component died (or never became ready) and the stack is going down."""


class Supervisor:
    def __init__(self, components: Sequence[Component], sink: LogSink, run_dir: Path, restarts: int = 0,
                 stop: threading.Event | None = None) -> None:
        self.components = list(components)
        self.sink, self.run_dir, self.max_restarts = sink, run_dir, restarts
        self.stop = stop or threading.Event()
        self.children: dict[str, Child] = {}

    # ---- start ----
    def spawn(self, comp: Component, restarts: int = 0) -> Child:
        for path, text in comp.files.items():
            Path(path).write_text(text)
        out = self.sink.stdout_for(comp.name)
        proc = subprocess.Popen(comp.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **comp.env, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True, preexec_fn=_child_setup(comp.cpus))
        if not isinstance(out, int):
            out.close()  # the child holds its own descriptor
        self.sink.attach(comp.name, proc)
        child = self.children[comp.name] = Child(comp, proc, time.monotonic(), restarts)
        self._write_state()
        return child

    def _write_state(self) -> None:
        """stack.json: what runs where, for users and tests (pids are process-group leaders)."""
        state = {name: {"role": c.comp.role, "pid": c.proc.pid, "url": c.comp.url, "argv": list(c.comp.argv),
                        "cpus": list(c.comp.cpus), "restarts": c.restarts} for name, c in self.children.items()}
        (self.run_dir / "stack.json").write_text(json.dumps(state, indent=2))

    def wait_ready(self, names: Sequence[str], timeout: float, on_ready: Callable[[str, float], None]) -> None:
        """Poll each component's readiness until all answer 200; StackDown if one exits,
        the timeout passes or a stop is asked for."""
        pending = list(names)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while pending:
                self.check_alive()
                for name in list(pending):
                    child = self.children[name]
                    try:
                        ok = client.get(child.comp.ready_url).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        pending.remove(name)
                        on_ready(name, time.monotonic() - child.started)
                if pending and (self.stop.wait(0.25) or time.monotonic() > deadline):
                    if self.stop.is_set():
                        raise StackDown("stopped before the stack was ready")
                    raise StackDown(f"not ready after {timeout:.0f} s: {', '.join(pending)}")

    # ---- run ----
    def check_alive(self) -> None:
        """A dead component is restarted (when allowed) or takes the stack down."""
        for name, child in list(self.children.items()):
            if child.proc.poll() is None:
                continue
            why = f"{name} exited ({child.exit_text()})"
            if self.stop.is_set():
                continue
            if child.restarts >= self.max_restarts:
                raise StackDown(why)
            self.sink.say(f"tandem up: {why}; restarting it ({child.restarts + 1}/{self.max_restarts})")
            _signal_group(child.proc, signal.SIGKILL)  # whatever it left behind holds its ports
            self.spawn(child.comp, child.restarts + 1)

    def watch(self, period: float = 0.5) -> None:
        """Until a stop is asked for (returns) or a component dies for good (StackDown)."""
        while not self.stop.wait(period):
            self.check_alive()

    # ---- stop ----
    def shutdown(self) -> None:
        """Router first, then every worker at once; whatever outlives its grace is killed."""
        self.stop.set()
        router = [c for c in self.children.values() if c.comp.name == ROUTER]
        workers = [c for c in self.children.values() if c.comp.name != ROUTER]
        for group, grace in ((router, ROUTER_STOP_S), (workers, WORKER_STOP_S)):
            for child in group:
                if child.proc.poll() is None:
                    # The leader only, as a kubelet signals PID 1: it drains and stops its own schedulers.
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for child in group:
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.sink.say(f"tandem up: {child.comp.name} did not stop in {grace:.0f} s; killing it")
        for child in self.children.values():
            # Also reaps the group's other members (a worker's scheduler processes).
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()
        self.sink.close()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
