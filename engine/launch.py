"""Where a scheduler is assembled, and the clients that reach one.

    build_scheduler(config, model_path, inbox, emit, attach) the one place a Scheduler is built
    InProcessScheduler    a scheduler on a thread of this process (the offline Engine, dp_size 1)
    run_scheduler_process one scheduler process fed over zmq (the DP controller's ranks, the server);
                          under tensor parallelism one per TP rank, of which rank 0 is fed

Every client satisfies `SchedulerClient`: `send` a protocol message, outputs come
back through the `emit` callback it was built with, `error` says why it stopped.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from tandem.engine import heap
from tandem.engine.device_map import bind_device, rank_device
from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler.role_part import AttachRole
from tandem.protocol.messages import AdminResult, ShutdownReq, decode, encode

Emit = Callable[[list[Any]], None]
# The AdminResult rid prefix a scheduler process's last message carries when its loop raised:
# the front learns why at once, rather than only that the process is gone.
FATAL = "fatal-rank-"


class SchedulerClient(Protocol):
    error: BaseException | None
    info: dict[str, Any]  # what the scheduler reported once ready (see scheduler_info)

    def send(self, msg: Any) -> None: ...

    def shutdown(self) -> None: ...


def build_scheduler(config: EngineConfig, model_path: str, inbox: Any, emit: Emit,
                    attach: AttachRole | None = None, dp_rank: int = 0, tp_rank: int = 0,
                    dist_addr: str | None = None) -> Any:
    """Load the model and wire a Scheduler; `attach` composes in a PD role's transfer part
    (prefill/role.py, decode/role.py: the caller picks it, the engine knows neither).
    The rank's GPU is made current first, so the weights, the KV pool and its sizing are on it.
    With tp_size > 1 the rank joins its replica's group at `dist_addr` first."""
    from transformers import AutoTokenizer

    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.scheduler.build import build_scheduler as assemble

    tokenizer: list[Any] = []
    lock = threading.Lock()

    def get_tokenizer() -> Any:
        """Loaded on first use (only stop strings and grammars need it), by the scheduler
        thread or the grammar compile thread, whichever asks first."""
        with lock:
            if not tokenizer:
                tokenizer.append(AutoTokenizer.from_pretrained(model_path))
            return tokenizer[0]

    import torch

    from tandem.engine.parallel.group import TPGroup

    device = rank_device(config, dp_rank, tp_rank)
    bind_device(device)
    tp = TPGroup.init(tp_rank, config.tp_size, dist_addr or "", torch.device(device))
    runner = ModelRunner(model_path, dataclasses.replace(config.runner_config(), device=device), tp)
    memory = runner.size_kv_memory()
    runner.attach(memory)
    return assemble(config, runner, memory, inbox, emit, get_tokenizer, dp_rank, model_path, attach)


def scheduler_info(sched: Any) -> dict[str, Any]:
    """Limits the front validates against before a request reaches the scheduler."""
    r = sched.runner
    return {
        "max_context_len": r.max_context_len, "vocab_size": r.vocab_size,
        "capacity_tokens": r.kv_pool.capacity_tokens, "page_size": r.page_size,
        "max_running_requests": sched.config.max_running_requests,
        "dtype": str(r.dtype).removeprefix("torch."), "device": str(r.device),
        "eos_token_ids": list(r.model_config.eos_token_ids),
    }


class InProcessScheduler:
    """dp_size == 1 in the offline Engine: the scheduler loop on a thread of this process."""

    def __init__(self, config: EngineConfig, model_path: str, emit: Emit) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.scheduler = build_scheduler(config, model_path, self.inbox, emit)
        self.info = scheduler_info(self.scheduler)
        self.thread = threading.Thread(target=self._run, name="tandem-scheduler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            from tandem.engine.scheduler.event_loops import run

            bind_device(self.info["device"])
            run(self.scheduler)
        except BaseException as exc:  # surfaced to callers through `error`
            self.error = exc
            raise

    def send(self, msg: Any) -> None:
        self.inbox.put(msg)

    def shutdown(self) -> None:
        """Stop the loop, then drop the scheduler and with it the runner: weights, KV memory,
        CUDA graphs. The Engine may outlive this client; the model must not. Idempotent."""
        if self.thread.is_alive():
            self.inbox.put(ShutdownReq())
            self.thread.join(timeout=30)
        if self.scheduler is None:
            return
        # A loop still running past the timeout holds its own reference: what it holds is
        # then freed when it ends, rather than never.
        self.scheduler = None
        drop_tracebacks(self.error)
        release_memory(self.info["device"])


def drop_tracebacks(exc: BaseException | None) -> None:
    """A stored error's traceback holds the scheduler's frames, and their locals the runner
    and its tensors (an OOM would keep the memory it failed for). The thread's excepthook
    has printed it already; the error itself stays for `error` to report."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def release_memory(device: str) -> None:
    """Free a dropped model now. Its parts reference each other, so only the cycle collector
    frees them; then PyTorch's caching allocator keeps the blocks reserved (used, to other
    processes and nvidia-smi) until empty_cache returns them to the driver. `device` is what the runner ran
    on: CUDA is touched only when the model was on it, so CPU runs never initialize it."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cpu_budget() -> int:
    """The cores this worker may use: OMP_NUM_THREADS when set, else the CPUs it is pinned to
    (`tandem up` pins each worker to its own cores; more threads than cores would make
    OpenMP's spinning threads fight each other), else every core."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_scheduler_process(config: EngineConfig, model_path: str, rank: int, in_addr: str, out_addr: str,
                          attach: AttachRole | None = None, threads: int | None = None,
                          tp_rank: int = 0, dist_addr: str | None = None) -> None:
    """Entry point of one scheduler process: messages in over zmq PULL, outputs out over
    PUSH. Its first output is AdminResult("ready-<rank>") carrying scheduler_info, or
    ok=False with the error if the model failed to load. Under tensor parallelism only TP
    rank 0 reads and answers; the other ranks get its inputs by broadcast (parallel/tick.py)
    and speak only to say that they failed."""
    import torch
    import zmq

    heap.tune()
    torch.set_num_threads(threads or max(1, cpu_budget() // (config.dp_size * config.tp_size)))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    inbox: queue.Queue = queue.Queue()
    leader = tp_rank == 0
    # Connected before the model loads: the front sends as soon as it reads "ready", and a
    # PUSH with no pipe yet would find this rank unreachable.
    pull = ctx.socket(zmq.PULL) if leader else None
    if pull is not None:
        pull.connect(in_addr)
    who = f"{rank}" if config.tp_size == 1 else f"{rank}.tp{tp_rank}"
    emit = (lambda outs: push.send_multipart([encode(o) for o in outs])) if leader else (lambda outs: None)
    try:
        sched = build_scheduler(config, model_path, inbox, emit, attach=attach, dp_rank=rank,
                                tp_rank=tp_rank, dist_addr=dist_addr)
    except Exception as exc:
        push.send_multipart([encode(AdminResult(f"ready-{rank}", False, {"error": f"{type(exc).__name__}: {exc}"}))])
        push.close(linger=2000)
        raise
    try:
        if leader:
            serve_inbox(pull, inbox)
            push.send_multipart([encode(AdminResult(f"ready-{rank}", True, scheduler_info(sched)))])
        from tandem.engine.scheduler.event_loops import run

        run(sched)
    except BaseException as exc:  # a fault batch_faults.py does not contain: this worker must go
        fatal = AdminResult(f"{FATAL}{who}", False, {"error": f"{type(exc).__name__}: {exc}"})
        try:
            push.send_multipart([encode(fatal)], zmq.NOBLOCK)
        except zmq.ZMQError:  # no front left to tell; blocking here would keep this process alive
            pass
        raise
    finally:
        push.close(linger=1000)
        sched.tp.close()


def serve_inbox(pull: Any, inbox: queue.Queue) -> None:
    """A thread that moves the front's messages from zmq into the scheduler's inbox."""
    parent = os.getppid()

    def pump() -> None:
        while True:
            if not pull.poll(1000):
                if os.getppid() != parent:  # the front died without a ShutdownReq: do not linger
                    inbox.put(ShutdownReq())
                    return
                continue
            msg = decode(pull.recv())
            inbox.put(msg)
            if isinstance(msg, ShutdownReq):
                return

    threading.Thread(target=pump, daemon=True).start()
