"""The all-reduce's share of a tensor-parallel step, beside the same steps on one rank.

Each rank runs the model runner directly (runner/static_generate.py: a prefill, then decode
steps in lockstep) and times its collectives (TPGroup.all_reduce and all_gather) against the
whole forward. TP=1 runs the same steps in the same process layout, one rank, for the ratio.

    python bench/tp_share.py --model small --batches 1,16 --steps 32        # CPU, gloo
    python bench/tp_share.py --model llama-1b-shape --device cuda --tp 2     # GPU, NCCL

Output: one line per (tp, batch) and a JSON to --out (docs/results/tp_share_<device>.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, addr: str, args: argparse.Namespace, out: Any) -> None:
    from tandem.engine.model_config import RunnerConfig
    from tandem.engine.modelgen.resolve import resolve_model
    from tandem.engine.parallel.group import TPGroup
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.runner.static_generate import StaticBatch

    torch.set_num_threads(max(1, args.threads // size))
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = TPGroup.init(rank, size, addr, device)
    spent = [0.0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name in ("all_reduce", "all_gather"):
        plain = getattr(tp, name)

        def timed(x: torch.Tensor, plain: Any = plain) -> torch.Tensor:
            sync()
            t = time.perf_counter()
            y = plain(x)
            sync()
            spent[0] += time.perf_counter() - t
            return y

        setattr(tp, name, timed)
    cfg = RunnerConfig(dtype=args.dtype, device=str(device), max_total_tokens=65536, max_running_requests=64,
                       disable_cuda_graph=True)  # graphs would hide the collectives from the timer
    runner = ModelRunner(resolve_model(args.model), cfg, tp)
    runner.attach(runner.size_kv_memory())
    sb = StaticBatch(runner)
    rows = []
    for batch in args.batches:
        seqs = sb.new(batch)
        sb.forward(seqs, [[1 + i % 50] * args.prompt for i in range(batch)])
        for warm in (True, False):
            spent[0] = 0.0
            sync()
            t = time.perf_counter()
            for _ in range(3 if warm else args.steps):
                sb.forward(seqs, [[7]] * batch)
            sync()
            total = time.perf_counter() - t
        sb.release(seqs)
        rows.append({"tp": size, "batch": batch, "step_ms": 1e3 * total / args.steps,
                     "collective_ms": 1e3 * spent[0] / args.steps, "share": spent[0] / total if size > 1 else 0.0})
    if rank == 0:
        out.put(rows)
    tp.close()


def run(size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, size, addr, args, out)) for r in range(size)]
    for p in procs:
        p.start()
    rows = out.get(timeout=1800)
    for p in procs:
        p.join()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    rows = run(1, args) + run(args.tp, args)
    for r in rows:
        print(f"tp {r['tp']} batch {r['batch']:3d}: step {r['step_ms']:8.2f} ms, collectives "
              f"{r['collective_ms']:7.2f} ms ({100 * r['share']:.0f}%)")
    one = {r["batch"]: r["step_ms"] for r in rows if r["tp"] == 1}
    for r in rows:
        if r["tp"] > 1:
            print(f"batch {r['batch']}: TP={r['tp']} step / TP=1 step = {r['step_ms'] / one[r['batch']]:.2f}x")
    out = Path(args.out or f"docs/results/tp_share_{args.device}.json")
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "threads": args.threads, "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
