"""Start `tandem serve` as a real process on a free 127.0.0.1 port, wait until ready, stop it.

Every server test goes through here, so every server is always stopped (SIGTERM, then
SIGKILL) and its log is shown when a test fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from waits import wait_until

from tandem import worker_contract as contract
from tandem.local.plan import free_port
from tandem.pd.secret import new_pd_secret

# Where the logs and run dirs of the processes tests start go: tests/conftest.py points it at
# pytest's own temp dir, which pytest prunes to the last three runs.
PROCESS_FILES = "TANDEM_TEST_PROCESS_FILES"

# Every worker a test starts shares one PD secret (the control channel runs CURVE, as in a
# cluster); env={ENV_PD_SECRET: ""} starts one without.
PD_SECRET = new_pd_secret()


def sglang_router(*args: str, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """The real sglang-router on a free port with `args`, up once it answers a /generate
    (its /health answers before its workers are registered). The caller terminates it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *args, "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("sglang-router exited")
        try:
            probe = {"text": "x", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            return httpx.post(url + "/generate", json=probe, timeout=10).is_success
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout, "sglang-router serving", interval=0.5)
    except (AssertionError, RuntimeError):
        proc.kill()
        raise RuntimeError("sglang-router did not come up") from None
    return proc, url


def free_port_for_offset(offset: int) -> int:
    """A free port whose port + offset and + offset + 1 are free too."""
    for _ in range(50):
        port = free_port()
        try:
            for p in (port + offset, port + offset + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free ports")


class Worker:
    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None, port: int | None = None,
                 api_key: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{free_port()}"  # its admin listener (drain, flush, abort, /workers)
        self.api_key = api_key
        self.bootstrap: int | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="tandem-serve-", suffix=".log", delete=False,
                                               dir=os.environ.get(PROCESS_FILES))
        cmd = [sys.executable, "-m", "tandem.cli", *argv, "--host", "127.0.0.1", "--port", str(self.port),
               "--admin-port", self.admin_url.rsplit(":", 1)[1]]
        key_env = {"TANDEM_API_KEY": api_key} if api_key else {}  # the env route of --api-key
        self._terminated = False
        # Its own session: a benchmark can freeze the whole worker (front and schedulers) with killpg.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, contract.ENV_PD_SECRET: PD_SECRET, **key_env, **(env or {})})

    @staticmethod
    def colocated_argv(model: Path, *flags: str, name: str = "tiny") -> list[str]:
        args = contract.WorkerArgs(role=contract.COLOCATED, model=str(model), served_model_name=name, config=None,
                                   extra=("--dtype", "float32", *flags))
        return contract.worker_argv(args)[1:]

    @classmethod
    def colocated(cls, model: Path, *flags: str, name: str = "tiny", **kw: object) -> Worker:
        return cls(cls.colocated_argv(model, *flags, name=name), **kw)  # type: ignore[arg-type]

    @classmethod
    def publishing_kv_events(cls, model: Path, *flags: str, offset: int = 3, name: str = "tiny") -> Worker:
        """A colocated worker publishing KV events on 127.0.0.1 at its HTTP port + `offset`, replays
        one port above (what `tandem router --kv-events-port-offset OFFSET --kv-events-replay` reads)."""
        port = free_port_for_offset(offset)
        cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "bind": True,
                          "endpoint": f"tcp://127.0.0.1:{port + offset}",
                          "replay_endpoint": f"tcp://127.0.0.1:{port + offset + 1}"})
        return cls.colocated(model, "--kv-events-config", cfg, *flags, name=name, port=port)

    @classmethod
    def prefill(cls, model: Path, *flags: str, name: str = "tiny", **kw: object) -> Worker:
        """A prefill worker; its bootstrap port is `.bootstrap`."""
        bootstrap = free_port()
        args = contract.WorkerArgs(role=contract.PREFILL, model=str(model), served_model_name=name, config=None,
                                   bootstrap_port=bootstrap, extra=("--dtype", "float32", *flags))
        w = cls(contract.worker_argv(args)[1:], **kw)  # type: ignore[arg-type]
        w.bootstrap = bootstrap
        return w

    @classmethod
    def decode(cls, model: Path, *flags: str, peers: Sequence[Worker | str] = (), name: str = "tiny",
               **kw: object) -> Worker:
        """A decode worker, handshaking with `peers` (prefill workers, or "host:port") at start."""
        keys = [p if isinstance(p, str) else f"127.0.0.1:{p.bootstrap}" for p in peers]
        peer_flags = ("--pd-prefill-peers", ",".join(keys)) if keys else ()
        args = contract.WorkerArgs(role=contract.DECODE, model=str(model), served_model_name=name, config=None,
                                   extra=("--dtype", "float32", *peer_flags, *flags))
        return cls(contract.worker_argv(args)[1:], **kw)  # type: ignore[arg-type]

    @classmethod
    def router(cls, model: Path, *flags: str, workers: Sequence[Worker] = (), prefill: Sequence[Worker] = (),
               decode: Sequence[Worker] = (), **kw: object) -> Worker:
        """`tandem router` in front of colocated `workers`, or of `prefill` + `decode` (PD)."""
        argv = ["router", "--model", str(model), "--health-interval", "0.5", *flags]
        if workers:
            argv += ["--workers", *(w.url for w in workers)]
        if prefill:
            argv += ["--prefill", *(f"{w.url}={w.bootstrap}" for w in prefill), "--decode", *(w.url for w in decode)]
        return cls(argv, **kw)  # type: ignore[arg-type]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_listening(self, timeout: float = 120) -> Worker:
        """Until its HTTP port answers at all (a decode whose handshake was refused is never
        ready, but it serves, with 503s): its log can say the refusal before it listens."""
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                httpx.get(self.url + contract.READY_PATH, timeout=2)
                return True
            except httpx.TransportError:
                return False

        wait_until(answers, timeout, f"{self.url} listening", interval=0.1)
        return self

    def wait_ready(self, timeout: float = 180) -> Worker:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(self.url + contract.READY_PATH, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ready, timeout, "tandem serve ready", interval=0.2)
            return self
        except AssertionError:
            self.stop()
            raise TimeoutError(f"tandem serve not ready in {timeout} s:\n{self.output()}") from None

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)  # type: ignore[arg-type]

    def post(self, path: str, json: object = None, **kw: object) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers=self.headers(), timeout=120, **kw)  # type: ignore[arg-type]

    def admin(self, method: str, path: str, json: object = None, **kw: object) -> httpx.Response:
        """An admin route, on the admin listener (no key needed there)."""
        return httpx.request(method, self.admin_url + path, json=json, timeout=120, **kw)  # type: ignore[arg-type]

    def pool(self) -> dict:
        """The pools' integrity, from outside: waits (bounded) until every rank is idle."""
        states: list[dict] = []

        def idle() -> bool:
            states.append(self.get("/debug/pool").json())
            return states[-1]["whole"] is not None

        try:
            wait_until(idle, 30, "every rank idle", interval=0.05)
        except AssertionError:
            pass  # the caller asserts on "whole" and shows the state
        return states[-1]

    def running(self) -> int:
        """Requests running on any rank now (their first token may not be out yet)."""
        return sum(r["num_running"] + r["num_waiting"] for r in self.get("/debug/pool").json()["ranks"])

    def wait_running(self, n: int = 1, timeout: float = 30) -> None:
        wait_until(lambda: self.running() >= n, timeout, f"{n} request(s) in flight on {self.url}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def terminate(self) -> None:
        """SIGTERM once (a second one would skip the drain); stop() waits for the exit."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> Worker:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def running(*workers: Worker) -> Iterator[tuple[Worker, ...]]:
    """Each worker ready (in order: a decode is ready once its prefill peers answer), then
    yielded; every one stopped after, also when one never became ready."""
    try:
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:  # SIGTERM to every one first: their drains and exits overlap
            w.terminate()
        for w in workers:
            w.stop()
