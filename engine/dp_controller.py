"""DataParallelController: dp_size scheduler processes behind one dispatcher.

    Engine --GenerateReq--> controller --zmq PUSH--> scheduler rank r
    Engine <--ReqOutput-------- controller <--zmq PULL-- all ranks

load_balance_method:
    round_robin            rank = n-th request mod dp_size
    total_requests         rank with the fewest unfinished requests
    total_tokens           rank with the fewest unfinished prompt+max_new tokens
    follow_bootstrap_room  rank = bootstrap_room mod dp_size (PD: the same room lands
                           on the same rank on both sides)

The HTTP server runs its schedulers this way even for dp_size 1, so no model work
shares the front's process. With tp_size > 1 each DP rank is tp_size processes, one
tensor-parallel group; the controller talks to the group's rank 0 only (engine/parallel/).
The counts are the controller's own bookkeeping of what it dispatched and saw
finish, so dispatch never waits on a round trip to the ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from tandem.engine import socket_dir
from tandem.engine.device_map import check_devices
from tandem.engine.engine_config import EngineConfig
from tandem.engine.launch import FATAL, run_scheduler_process
from tandem.engine.scheduler.role_part import AttachRole
from tandem.protocol.messages import (
    AbortReq,
    AdminResult,
    GenerateReq,
    ReqOutput,
    ShutdownReq,
    decode,
    dispatch,
    encode,
    is_admin,
)


class RankUnreachable(RuntimeError):
    """A scheduler rank's process is gone; messages to it cannot be delivered."""


class DPBudget:
    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.total_requests = [0] * dp_size
        self.total_tokens = [0] * dp_size
        self._rr = 0

    def dispatch(self, method: str, msg: GenerateReq) -> int:
        if method == "follow_bootstrap_room":
            if msg.bootstrap_room is None:
                raise ValueError("follow_bootstrap_room needs a bootstrap_room on every request")
            rank = msg.bootstrap_room % self.dp_size
        elif method == "total_requests":
            rank = min(range(self.dp_size), key=lambda i: (self.total_requests[i], i))
        elif method == "total_tokens":
            rank = min(range(self.dp_size), key=lambda i: (self.total_tokens[i], self.total_requests[i], i))
        else:
            rank, self._rr = self._rr, (self._rr + 1) % self.dp_size
        return rank

    def add(self, rank: int, tokens: int) -> None:
        self.total_requests[rank] += 1
        self.total_tokens[rank] += tokens

    def remove(self, rank: int, tokens: int) -> None:
        self.total_requests[rank] -= 1
        self.total_tokens[rank] -= tokens


def tp_rendezvous(config: EngineConfig, dp_rank: int) -> str | None:
    """Where DP rank `dp_rank`'s tensor-parallel group meets: dist_init_addr's port + dp_rank,
    or a free loopback port (all ranks on this machine)."""
    if config.tp_size == 1:
        return None
    if config.dist_init_addr is not None:
        host, _, port = config.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    with socket.socket() as s:  # the port is free now; rank 0 binds it within a second
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class DataParallelController:
    def __init__(self, config: EngineConfig, model_path: str, emit: Callable[[list[Any]], None] | None = None,
                 attach: AttachRole | None = None, threads: int | None = None, ready_timeout: float = 600.0) -> None:
        """Spawns the ranks. With `emit`, also waits for them and serves (serve()); without, returns
        at once, and the caller calls serve() when it has done its own start-up meanwhile: the
        server starts its ranks before it imports its web stack, so the two overlap."""
        check_devices(config)  # here, before any rank is spawned to find its GPU missing
        self.config = config
        self.emit: Callable[[list[Any]], None] = lambda outs: None
        self.info: dict[str, Any] = {}
        self.budget = DPBudget(config.dp_size)
        self.error: BaseException | None = None
        self._closed = False
        self.owner: dict[str, tuple[int, int]] = {}  # rid -> (rank, tokens)
        self._lock = threading.Lock()
        self.ctx = zmq.Context()
        # Under a 0700 directory, never abstract sockets, which any process in the network
        # namespace can reach (engine/socket_dir.py); a killed server's is swept at the next start.
        self.sockets: str | None = str(socket_dir.make())
        base = f"ipc://{self.sockets}"
        out_addr = f"{base}/out"
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(out_addr)
        self.pushes = []
        spawn = mp.get_context("spawn")
        self.procs = []
        for rank in range(config.dp_size):
            addr = f"{base}/in{rank}"
            s = self.ctx.socket(zmq.PUSH)
            s.bind(addr)
            self.pushes.append(s)
            dist_addr = tp_rendezvous(config, rank)
            for tp_rank in range(config.tp_size):
                p = spawn.Process(
                    target=run_scheduler_process, daemon=True,
                    args=(config, model_path, rank, addr, out_addr, attach, threads, tp_rank, dist_addr),
                )
                p.start()
                self.procs.append(p)
        self._routes = {GenerateReq: self._send_generate, AbortReq: self._send_abort}
        self._stopping = threading.Event()
        self._reader: threading.Thread | None = None
        if emit is not None:
            self.serve(emit, ready_timeout)

    def serve(self, emit: Callable[[list[Any]], None], ready_timeout: float = 600.0) -> DataParallelController:
        """Waits until every rank has its model loaded (raises if one fails or dies), then
        delivers the ranks' outputs to `emit` from a reader thread."""
        self.emit = emit
        self.info = self._wait_ready(ready_timeout)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        """Every rank's ready message (its model loaded); raises if one fails or dies."""
        infos: dict[int, dict[str, Any]] = {}
        waited = 0.0
        while len(infos) < self.config.dp_size:
            if not self.pull.poll(500):
                waited += 0.5
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead or waited > timeout:
                    self._kill()
                    raise RuntimeError(f"scheduler rank(s) {dead} exited while loading" if dead
                                       else f"schedulers not ready after {timeout:.0f} s")
                continue
            ready = decode(self.pull.recv_multipart()[0])
            if not ready.ok:
                self._kill()
                raise RuntimeError(f"scheduler {ready.rid} failed to start: {ready.info.get('error')}")
            infos[int(ready.rid.rsplit("-", 1)[1])] = ready.info
        return infos[0]

    def _kill(self) -> None:
        self._closed = True  # shutdown() after a failed start has nothing left to do
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        self.pull.close(linger=0)
        for s in self.pushes:
            s.close(linger=0)
        shutil.rmtree(self.sockets, ignore_errors=True)

    def _read(self) -> None:
        # Polls with a timeout so shutdown can stop it: zmq sockets must not be closed
        # from another thread while this one blocks on them.
        next_check = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_check:  # on a clock: one rank's outputs must not hide another's death
                self._check_ranks()
                next_check = time.monotonic() + 0.1
            if not self.pull.poll(100):
                continue
            frames = self.pull.recv_multipart()
            outs = [decode(f) for f in frames]
            for o in outs:
                if isinstance(o, ReqOutput) and o.finished:
                    with self._lock:
                        rank, tokens = self.owner.pop(o.rid, (None, 0))
                        if rank is not None:
                            self.budget.remove(rank, tokens)
                elif isinstance(o, AdminResult) and o.rid.startswith(FATAL) and self.error is None:
                    who = o.rid.removeprefix(FATAL)
                    self.error = RuntimeError(f"scheduler rank {who} failed: {o.info.get('error')}")
            self.emit(outs)

    def _check_ranks(self) -> None:
        """A rank gone while serving is an error; during shutdown it is the point."""
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead and self.error is None and not self._closed:
            self.error = RuntimeError(f"DP rank(s) {dead} exited")

    def send(self, msg: Any) -> None:
        """Admin commands go to every rank (each answers); requests follow the route table.
        Raises RankUnreachable instead of blocking when a rank is gone."""
        if self._closed:  # a RuntimeError, like a gone rank, not a ZMQError from a closed socket
            raise RankUnreachable("the scheduler processes were shut down")
        if is_admin(msg):
            for rank in range(len(self.pushes)):
                self._push(rank, msg)
        else:
            dispatch(msg, self._routes)

    def _push(self, rank: int, msg: Any) -> None:
        # A PUSH socket whose peer died has no pipe left, and a blocking send would wait
        # forever (it once hung a server's shutdown, and would hang its event loop).
        try:
            self.pushes[rank].send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            if self.error is None:
                self.error = RankUnreachable(f"scheduler rank {rank} is not reachable")
            raise RankUnreachable(f"scheduler rank {rank} is not reachable") from None

    def _send_generate(self, msg: GenerateReq) -> None:
        tokens = len(msg.input_ids) + int(msg.sampling.get("max_new_tokens", 128))
        with self._lock:
            rank = self.budget.dispatch(self.config.load_balance_method, msg)
            self.budget.add(rank, tokens)
            self.owner[msg.rid] = (rank, tokens)
        self._push(rank, msg)

    def _send_abort(self, msg: AbortReq) -> None:
        with self._lock:
            rank = self.owner.get(msg.rid, (None, 0))[0]
        for i in range(len(self.pushes)):
            if rank is None or i == rank:
                self._push(i, msg)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in range(len(self.pushes)):
            try:
                self._push(rank, ShutdownReq())
            except RankUnreachable:  # already gone: nothing to stop
                pass
        if self._reader is None:  # never served: ranks still loading have nothing to drain
            for p in self.procs:
                p.terminate()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.pull.close(linger=0)
        for s in self.pushes:
            s.close(linger=0)
        self.ctx.term()  # every socket is closed with linger 0: this cannot block
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)  # the ipc socket files
        # Reaped (joined) above: drop the handles, and their pipes and sentinels with them.
        for p in self.procs:
            if not p.is_alive():
                p.close()
        self.procs = []
