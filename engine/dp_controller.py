"""DataParallelController: dp_size scheduler processes behind one dispatcher.

    Engine --GenerateReqInput--> controller --zmq PUSH--> scheduler rank r
    Engine <--ReqOutput-------- controller <--zmq PULL-- all ranks

load_balance_method:
    round_robin            rank = n-th request mod dp_size
    total_requests         rank with the fewest unfinished requests
    total_tokens           rank with the fewest unfinished prompt+max_new tokens
    follow_bootstrap_room  rank = bootstrap_room mod dp_size (PD: the same room lands
                           on the same rank on both sides)

The counts are the controller's own bookkeeping of what it dispatched and saw
finish, so dispatch never waits on a round trip to the ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import zmq

from tandem.engine.engine_config import EngineConfig
from tandem.engine.io_struct import (
    AbortReq,
    AdminResult,
    FlushCacheReq,
    GenerateReqInput,
    ReqOutput,
    ShutdownReq,
    decode,
    encode,
)


class DPBudget:
    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.total_requests = [0] * dp_size
        self.total_tokens = [0] * dp_size
        self._rr = 0

    def dispatch(self, method: str, msg: GenerateReqInput) -> int:
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


def run_scheduler_process(config: EngineConfig, model_path: str, rank: int, in_addr: str, out_addr: str) -> None:
    """Entry point of one DP rank: a Scheduler fed over zmq."""
    import queue

    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.dp_size))
    from transformers import AutoTokenizer

    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.scheduler import Scheduler

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    inbox: queue.Queue = queue.Queue()
    tok = AutoTokenizer.from_pretrained(model_path)
    runner = ModelRunner(model_path, config.runner_config())
    emit = lambda outs: push.send_multipart([encode(o) for o in outs])  # noqa: E731
    sched = Scheduler(config, runner, inbox, emit, lambda: tok, dp_rank=rank)

    def pump() -> None:
        while True:
            msg = decode(pull.recv())
            inbox.put(msg)
            if isinstance(msg, ShutdownReq):
                return

    threading.Thread(target=pump, daemon=True).start()
    push.send_multipart([encode(AdminResult(f"ready-{rank}", True))])
    sched.run()
    push.close(linger=1000)


class DataParallelController:
    def __init__(self, config: EngineConfig, model_path: str, emit: Callable[[list[Any]], None]) -> None:
        self.config = config
        self.emit = emit
        self.budget = DPBudget(config.dp_size)
        self.error: BaseException | None = None
        self._closed = False
        self.owner: dict[str, tuple[int, int]] = {}  # rid -> (rank, tokens)
        self._lock = threading.Lock()
        self.ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="tandem-dp-")
        out_addr = f"ipc://{self._dir}/out"
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(out_addr)
        self.pushes = []
        spawn = mp.get_context("spawn")
        self.procs = []
        for rank in range(config.dp_size):
            addr = f"ipc://{self._dir}/in{rank}"
            s = self.ctx.socket(zmq.PUSH)
            s.bind(addr)
            self.pushes.append(s)
            p = spawn.Process(
                target=run_scheduler_process, args=(config, model_path, rank, addr, out_addr), daemon=True
            )
            p.start()
            self.procs.append(p)
        for _ in range(config.dp_size):  # wait until every rank has its model loaded
            decode(self.pull.recv_multipart()[0])
        self._stopping = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # Polls with a timeout so shutdown can stop it: zmq sockets must not be closed
        # from another thread while this one blocks on them.
        while not self._stopping.is_set():
            if not self.pull.poll(100):
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead and self.error is None:
                    self.error = RuntimeError(f"DP rank(s) {dead} exited")
                continue
            frames = self.pull.recv_multipart()
            outs = [decode(f) for f in frames]
            for o in outs:
                if isinstance(o, ReqOutput) and o.finished:
                    with self._lock:
                        rank, tokens = self.owner.pop(o.rid, (None, 0))
                        if rank is not None:
                            self.budget.remove(rank, tokens)
            self.emit(outs)

    def send(self, msg: Any) -> None:
        if isinstance(msg, GenerateReqInput):
            tokens = len(msg.input_ids) + int(msg.sampling.get("max_new_tokens", 128))
            with self._lock:
                rank = self.budget.dispatch(self.config.load_balance_method, msg)
                self.budget.add(rank, tokens)
                self.owner[msg.rid] = (rank, tokens)
            self.pushes[rank].send(encode(msg))
        elif isinstance(msg, AbortReq):
            with self._lock:
                rank = self.owner.get(msg.rid, (None, 0))[0]
            for i, s in enumerate(self.pushes):
                if rank is None or i == rank:
                    s.send(encode(msg))
        elif isinstance(msg, (FlushCacheReq, ShutdownReq)):
            for s in self.pushes:
                s.send(encode(msg))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.send(ShutdownReq())
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self._stopping.set()
        self._reader.join(timeout=5)
        self.pull.close(linger=0)
        for s in self.pushes:
            s.close(linger=0)
