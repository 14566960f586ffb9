"""The host's share of a GPU decode step, measured on any machine: the real scheduler, worker, runner,
FlashInfer backend and CUDA-graph runner, with the device work stubbed out.

    python bench/host_step.py                          # batches 1, 64, 256; JSON to docs/results/host_step.json
    python bench/host_step.py --batches 1,64 --steps 32 --out /tmp/host.json

On a GPU the decode step's kernels run inside a CUDA-graph replay, which costs the host one call.
What the host still does each step is Python and torch ops outside the graph: building the batch,
copying it to the device, planning attention, sampling, storing futures. Each torch op is a trip
through the dispatcher (tens of microseconds on a GPU host, measured on the H200: docs/gpu.md).
This benchmark runs exactly that host path on the CPU:

- the model is a stub whose forward reads nothing and returns a static logits buffer, and a graph
  replay does nothing (what a captured graph computes is device work);
- the attention backend is the FlashInfer backend over the CPU stand-in of FlashInfer's wrappers
  (tests/support/fake_flashinfer.py); the ops inside FlashInfer's plans are FlashInfer's, not ours
  (the stand-in's differ from the real one's), so they are counted apart, as are the plan calls,
  and so are the stand-in's fences of its plan copies (a CUDA event on a GPU: no torch op);
- the request-row table keeps a host mirror, as off the CPU;
- the scheduler runs its overlap loop on its thread, the forward on its own, as in serving;
- every request is greedy, the common serving case.

Reported per decode step (steady state: every request decoding, none finishing): the wall time, the
process CPU time, and the torch ops dispatched outside the graph, by thread and by name: each op
that reaches the dispatcher, counted by a dispatch mode in both threads (a separate run: the mode
slows them). Ops are the figure that carries over to a GPU host, where each is a dispatch and most
a launch or a copy. Host microseconds here are a CPU's, over tiny tensors, and on 2 cores the two
threads contend for them: read them as a ratio within one run, not as a GPU host's time.
`HOST_STEP_TRACE=op1,op2` prints where those ops are called from.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import queue
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
TRACE = set(filter(None, os.environ.get("HOST_STEP_TRACE", "").split(",")))  # ops whose callers to print
sys.path.insert(0, str(ROOT / "tests" / "support"))


class _Patch:
    """What fake_flashinfer.install asks of pytest's monkeypatch, applied for the process's life."""

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        mapping[key] = value

    def setattr(self, target: Any, name: Any, value: Any = None, raising: bool = True) -> None:
        setattr(target, name, value)


class StubModel(torch.nn.Module):
    """The device work of a forward, stubbed: logits from a static buffer, nothing computed."""

    def __init__(self, max_rows: int, vocab: int) -> None:
        super().__init__()
        self.logits = torch.zeros(max_rows, vocab)

    def forward(self, batch: Any, backend: Any) -> torch.Tensor:
        return self.logits[: batch.batch_size]


class NoReplay:
    """A capture whose replay costs the host nothing, as a real graph replay costs it one call."""

    def capture(self, fn: Any) -> tuple[Any, torch.Tensor]:
        out = fn()
        return SimpleNamespace(replay=lambda: None), out


def build(model: str, max_bs: int, context: int, patch: Any) -> Any:
    """A Scheduler over a stubbed runner: FlashInfer backend (stand-in) and graphs up to max_bs.
    `patch` applies the stand-in's patches (a test's monkeypatch undoes them after)."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.kvcache import kv_memory
    from tandem.engine.kvcache.req_table import ReqToTokenPool
    from tandem.engine.modelgen.resolve import resolve_model
    from tandem.engine.runner.cuda_graph_runner import CudaGraphRunner
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.scheduler.build import build_scheduler

    fake_flashinfer.install(patch)
    # Off the CPU the request-row table keeps a host mirror, and the scheduler writes the mirror:
    # forced on here, so the scheduler's side is the GPU's.
    patch.setattr(kv_memory, "ReqToTokenPool", functools.partial(ReqToTokenPool, host_mirror=True))
    path = str(resolve_model(model))
    config = EngineConfig.from_kwargs(
        model=path, device="cpu", dtype="bfloat16", page_size=16, disable_overlap_schedule=False,
        max_running_requests=max_bs,
        max_total_tokens=max_bs * (context + 64) + 1024, max_context_len=context + 64,
        chunked_prefill_size=max(8192, max_bs * context), max_prefill_tokens=max(8192, max_bs * context))
    runner = ModelRunner(path, config.runner_config())
    runner.attach(runner.size_kv_memory())
    runner.model = StubModel(max(max_bs, 1), runner.vocab_size)
    runner.attn_backend = FlashInferAttentionBackend(runner)
    runner.graph_runner = CudaGraphRunner(runner, max_bs, capture=NoReplay())
    outs: queue.SimpleQueue = queue.SimpleQueue()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sched = build_scheduler(config, runner, runner.memory, inbox, outs.put, lambda: None)
    return sched, inbox, outs


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that reach the dispatcher's kernels, per thread, while `on`; ops inside
    FlashInfer's `plan` (the stand-in's here, the real one's on a GPU) are counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: Counter = Counter()
        self.plan_ops = 0
        self.plans = 0
        self.local = threading.local()
        self.traces: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on:
            if getattr(self.local, "in_plan", False):
                self.plan_ops += 1
            else:
                self.ops[(threading.current_thread().name, str(func.overloadpacket.__name__))] += 1
                if TRACE and str(func.overloadpacket.__name__) in TRACE:
                    import traceback

                    self.traces[str(func)] += 1
                    self.traces["".join(traceback.format_stack(limit=6)[:-1])] += 1
        return func(*args, **(kwargs or {}))

    def foreign(self, fn: Any, plan: bool = False) -> Any:
        """`fn` with its ops counted apart: FlashInfer's plans (counted as calls too), and the
        stand-in's fence of its plan copies (a CUDA event's wait on a GPU, no torch op)."""
        counter = self

        def run(*a: Any, **kw: Any) -> Any:
            counter.plans += counter.on and plan
            counter.local.in_plan = True
            try:
                return fn(*a, **kw)
            finally:
                counter.local.in_plan = False

        return run

    def mark_foreign(self, backend: Any, patch: Any) -> None:
        import flashinfer

        targets = [(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan", True),
                   (torch.cpu.Event, "synchronize", False), (torch.cpu.Event, "record", False)]
        for owner, name, plan in targets:
            raw = getattr(owner, name)
            raw = getattr(raw, "__wrapped__", raw)  # one wrapper, however many runs
            wrapped = self.foreign(raw, plan)
            wrapped.__wrapped__ = raw  # type: ignore[attr-defined]
            patch.setattr(owner, name, wrapped)
        if getattr(backend, "_fast_plan", None) is not None:
            backend._fast_plan = self.foreign(backend._fast_plan, plan=True)


def steady_decode(batch: int, steps: int, context: int, model: str, max_bs: int, count: bool,
                  patch: Any = None) -> dict[str, Any]:
    """`steps` decode steps of `batch` requests after a warm-up, every request decoding throughout:
    timed (wall and process CPU per step) or, with `count`, their torch ops counted (which slows
    them: the two are separate runs)."""
    from tandem.protocol.messages import GenerateReq, ShutdownReq

    patch = patch or _Patch()
    sched, inbox, outs = build(model, max_bs, context, patch)
    counter = OpCounter()
    counter.mark_foreign(sched.runner.attn_backend, patch)
    g = torch.Generator().manual_seed(batch)
    warm = 4
    for i in range(batch):  # room past the window: no request finishes inside it
        ids = torch.randint(10, sched.runner.vocab_size, (context,), generator=g).tolist()
        params = {"max_new_tokens": warm + steps + 8, "ignore_eos": True, "temperature": 0.0}
        inbox.put(GenerateReq(f"r{i}", ids, params, 0))

    def counted(fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            with counter:
                return fn(*a, **kw)
        return run

    if count:  # modes are per thread: the scheduler's loop and each forward on the forward thread
        sched.worker.forward_batch_generation = counted(sched.worker.forward_batch_generation)
    from tandem.engine.scheduler.event_loops import run as run_loop

    loop = functools.partial(run_loop, sched)
    thread = threading.Thread(target=counted(loop) if count else loop, name="scheduler", daemon=True)
    thread.start()
    tokens = start = 0
    wall0 = cpu0 = 0.0
    try:
        while True:
            tokens += sum(len(getattr(o, "token_ids", None) or []) for o in outs.get(timeout=300))
            if not start and tokens >= (warm + 1) * batch:  # the prefill's token and warm-up steps
                start = tokens
                wall0, cpu0 = time.perf_counter(), time.process_time()
                counter.on = count
            elif start and tokens - start >= steps * batch:
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                counter.on = False
                break
    finally:
        inbox.put(ShutdownReq())
        thread.join(timeout=60)
    n = (tokens - start) / batch
    if not count:
        return {"us_per_step": wall / n * 1e6, "cpu_us_per_step": cpu / n * 1e6}
    for where, c in counter.traces.most_common(6):
        print(f"--- {c}x\n{where}")
    role = lambda t: "scheduler" if t == "scheduler" else "forward"  # noqa: E731
    threads: Counter = Counter()
    for (t, _), c in counter.ops.items():
        threads[role(t)] += c
    return {
        "ops_per_step": sum(threads.values()) / n,
        "ops_per_step_by_thread": {t: c / n for t, c in sorted(threads.items())},
        "plan_calls_per_step": counter.plans / n,
        "flashinfer_plan_ops_per_step": counter.plan_ops / n,
        "top_ops": [{"thread": role(t), "op": op, "per_step": c / n} for (t, op), c in counter.ops.most_common(30)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "host_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for b in batches:
        row = {"batch": b, **steady_decode(b, args.steps, args.context, args.model, max(batches), count=False),
               **steady_decode(b, args.steps, args.context, args.model, max(batches), count=True)}
        rows.append(row)
        print(f"batch {b:>4}: {row['us_per_step']:8.0f} us/step wall, {row['cpu_us_per_step']:8.0f} us CPU, "
              f"{row['ops_per_step']:6.1f} torch ops/step {row['ops_per_step_by_thread']}, "
              f"plan {row['plan_calls_per_step']:.1f}/step")
    out = {"bench": "host_step", "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "steps": args.steps, "context": args.context, "model": args.model, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
