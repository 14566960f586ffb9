"""Where a decode step's host time goes: the wall time of the engine's step functions, per thread,
per decode step, beside the step time and the GPU time of one graph replay alone.

    python bench/step_profile.py --model small --batches 1,64            # GPU: overlap on and off
    python bench/step_profile.py --model tiny --device cpu --batches 1,4 --steps 8

The functions listed in TIMED are wrapped (inclusive wall time, so nested rows add up inside
their parents). Timing covers only the decode generate of gpu_decode.py's method (prompts in
the prefix cache), so a row's `us/step` is its time over the steps of that call. On CUDA
`graph replay (GPU)` replays the batch's graph alone, synchronised, which is what a step
would cost without any host work. Output: a table per (batch, loop) and a JSON to --out, with
what ran per loop (run_meta.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_decode import engine_args, flush, prompts_for, resolve, sp
from run_meta import engine_meta, environment

TIMED = [
    ("tandem.engine.scheduler.scheduler", "Scheduler.recv_requests"),
    ("tandem.engine.scheduler.scheduler", "Scheduler.process_input_requests"),
    ("tandem.engine.scheduler.scheduler", "Scheduler.get_next_batch_to_run"),
    ("tandem.engine.scheduler.scheduler", "Scheduler.process_batch_result"),
    ("tandem.engine.scheduler.schedule_batch", "ScheduleBatch.get_model_worker_batch"),
    ("tandem.engine.runner.model_worker", "OverlapWorker.launch"),
    ("tandem.engine.runner.model_worker", "GenerationBatchResult.materialize"),
    ("tandem.engine.runner.model_worker", "ModelWorker.forward_batch_generation"),
    ("tandem.engine.runner.model_worker", "StreamHandoff.wait"),
    ("tandem.engine.forward_batch", "ForwardBatch.build"),
    ("tandem.engine.runner.future_map", "FutureMap.resolve"),
    ("tandem.engine.runner.future_map", "FutureMap.store"),
    ("tandem.engine.runner.model_runner", "ModelRunner.forward"),
    ("tandem.engine.runner.model_runner", "ModelRunner.sample"),
    ("tandem.engine.runner.sampler", "SamplingBatch.from_params"),
    ("tandem.engine.runner.cuda_graph_runner", "CudaGraphRunner.decode"),
    ("tandem.engine.runner.cuda_graph_runner", "CudaGraphRunner.replay"),
    ("tandem.engine.runner.graph_inputs", "DecodeGraphInputs.fill"),
    ("tandem.engine.attention.flashinfer_backend", "FlashInferAttentionBackend.plan_graph_decode"),
    ("tandem.engine.attention.flashinfer_backend", "FlashInferAttentionBackend._fenced_plan"),
    ("tandem.engine.attention.flashinfer_backend", "FlashInferAttentionBackend._table"),
    ("tandem.engine.attention.flashinfer_backend", "page_indices"),
    ("tandem.engine.attention.flashinfer_backend", "host_page_counts"),
    ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper.plan"),
    ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper.run"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("torch.cuda", "Event.synchronize"),
    ("torch.cuda", "Event.record"),
]


class Timers:
    """Inclusive wall time and calls per (thread, function) while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.stats: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
        self.undo: list[Callable[[], None]] = []

    def wrap(self, module: str, qualname: str) -> None:
        try:
            owner: Any = importlib.import_module(module)
        except ImportError:
            return
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                return
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if raw is None:
            return
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        fn = raw.__func__ if kind is not None else raw
        timers = self

        def timed(*args: Any, **kw: Any) -> Any:
            if not timers.on:
                return fn(*args, **kw)
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                row = timers.stats[(threading.current_thread().name, qualname)]
                row[0] += 1
                row[1] += time.perf_counter() - t

        setattr(owner, name, kind(timed) if kind is not None else timed)
        self.undo.append(lambda: setattr(owner, name, raw))

    def table(self, steps: int) -> list[dict[str, Any]]:
        rows = [{"thread": th, "function": fn, "calls_per_step": n / steps, "us_per_step": s / steps * 1e6}
                for (th, fn), (n, s) in self.stats.items()]
        return sorted(rows, key=lambda r: (r["thread"], -r["us_per_step"]))


def replay_ms(eng: Any, batch: int, reps: int = 50) -> float | None:
    """GPU time of one replay of the bucket that runs `batch` rows, nothing else around it."""
    runner = eng.scheduler.runner
    graphs = getattr(runner, "graph_runner", None)
    if graphs is None:
        return None
    bucket = min(b for b in graphs.buckets if b >= batch)
    graph = graphs.graphs[bucket]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def replay_kernels(eng: Any, batch: int, reps: int = 10, top: int = 15) -> list[dict[str, Any]]:
    """The kernels inside one replay of the batch's graph: count and GPU time per replay, by name."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    graphs = eng.scheduler.runner.graph_runner
    graph = graphs.graphs[min(b for b in graphs.buckets if b >= batch)]
    graph.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "per_replay": e.count / reps, "us_per_replay": e.device_time_total / reps}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_replay"])[:top]


def profile(eng: Any, timers: Timers, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompts = prompts_for(batch, args.context, vocab, seed=batch)
    flush(eng)
    eng.generate(prompts, sp(2))  # the prompts into the prefix cache, one decode step
    t = time.perf_counter()
    eng.generate(prompts, sp(1))
    one = time.perf_counter() - t
    timers.stats.clear()
    timers.on = True
    t = time.perf_counter()
    eng.generate(prompts, sp(args.steps))
    many = time.perf_counter() - t
    timers.on = False
    step_ms = (many - one) / (args.steps - 1) * 1e3
    gpu = args.device != "cpu" and torch.cuda.is_available()
    return {"batch": batch, "step_ms": step_ms, "replay_ms": replay_ms(eng, batch) if gpu else None,
            "rows": timers.table(args.steps), "kernels": replay_kernels(eng, batch) if gpu and args.kernels else []}


def show(res: dict[str, Any], loop: str) -> None:
    replay = f"{res['replay_ms']:.3f} ms" if res["replay_ms"] is not None else "-"
    print(f"\n== batch {res['batch']}, {loop}: step {res['step_ms']:.3f} ms, graph replay (GPU) {replay}")
    for r in res["rows"]:
        print(f"  {r['thread']:<16} {r['function']:<48} {r['calls_per_step']:>6.2f}/step {r['us_per_step']:>9.1f} us")
    for k in res["kernels"]:
        print(f"  gpu kernel {k['kernel']:<90} {k['per_replay']:>6.1f}x {k['us_per_replay']:>9.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--loops", default="overlap,normal", help="overlap, normal or both")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--kernels", action="store_true", help="CUDA: the kernels in one graph replay (profiler)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoConfig

    from tandem import Engine

    path = resolve(args.model)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    timers = Timers()
    for module, qualname in TIMED:
        timers.wrap(module, qualname)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    out: dict[str, Any] = {"model": args.model, "runs": [], "meta": {"environment": environment(device), "engines": {}}}
    for loop in args.loops.split(","):
        cfg = {"device": args.device, "cuda_graph_max_bs": max(batches),
               "disable_overlap_schedule": loop == "normal", **engine_args(args.engine_arg)}
        eng = Engine(model=str(path), **cfg)
        try:
            out["meta"]["engines"][loop] = engine_meta(eng)
            for b in batches:
                res = profile(eng, timers, b, args, vocab)
                show(res, loop)
                out["runs"].append({"loop": loop, **res})
        finally:
            eng.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
