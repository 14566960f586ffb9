"""Offline throughput of our Engine, side by side with a second configuration or vLLM.

    # us vs vLLM's CPU backend (vLLM runs in its own venv, see bench/README.md);
    # --shapes prefill,decode splits the workload into its two phases
    python bench/throughput.py vllm --model small --rounds 6
    # overlap vs normal loop, with the device idle gap between decode forwards
    python bench/throughput.py overlap --model tiny
    # radix cache vs none, and lpm vs fcfs, on a shared-prefix workload
    python bench/throughput.py radix --model tiny
    # scheduler CPU time per decode step per request at batch 64 and 256
    python bench/throughput.py overhead --model tiny

A and B alternate (A B A B ...) so drift on a shared machine hits both; each
figure is the per-round ratio's median. Results go to docs/results/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workloads import SHAPES, Request, named_workload, shared_prefix_workload, throughput_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python")


def run_ours(model: str, requests: list[Request], threads: int, **config) -> dict:
    """Build an Engine, warm it up, time generate() over the whole workload."""
    import torch

    torch.set_num_threads(threads)
    from tandem import Engine

    with Engine(model, **config) as eng:
        _warm_up(eng)
        res = _timed_generate(eng, requests)
    assert res["output_tokens"] == sum(r.max_new_tokens for r in requests), "ignore_eos must give max_new_tokens"
    return {"engine": "tandem", **res}


class VllmServer:
    """vLLM's engine, warm, in its own venv and process (vllm_offline.py --serve):
    `run(shape)` is one timed generate there. Only its timed call is measured."""

    def __init__(self, model_dir: str, dtype: str, n: int) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
        # vLLM's CPU backend asks for tcmalloc + Intel OpenMP preloaded (about 2x without them).
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               str(Path(VLLM_PYTHON).parent.parent / "lib/libiomp5.so")) if Path(p).exists()]
        env.setdefault("LD_PRELOAD", ":".join(preload))
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, str(ROOT / "bench/vllm_offline.py"), "--model", model_dir, "--dtype", dtype,
             "--num-requests", str(n), "--serve"], env=env,
            cwd=tempfile.gettempdir(),  # not the repo root: its operator/ folder would shadow the stdlib module
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._read("READY")

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:  # vLLM logs to stdout too: skip to our tagged line
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"vLLM exited (rc {self.proc.wait()}); run bench/vllm_offline.py by hand to see why")

    def run(self, shape: str) -> dict:
        self.proc.stdin.write(shape + "\n")
        self.proc.stdin.flush()
        return {"engine": "vllm", **json.loads(self._read("RESULT"))}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compare_with_vllm(args: argparse.Namespace, config: dict) -> dict:
    """Our engine in this process and vLLM's in its own, both warm, take turns shape by
    shape (the order flips each round), so each ratio pairs two runs seconds apart."""
    from tandem import Engine

    path, vocab = _model(args)
    vllm = VllmServer(path, args.dtype, 64)
    res: dict = {"protocol": "both warm, alternating run by run, order flipped each round"}
    try:
        with Engine(path, **config) as eng:
            _warm_up(eng)
            for shape in args.shapes.split(","):
                reqs = named_workload(shape, vocab_size=vocab)
                rows = []
                for i in range(args.rounds):
                    runs = {}
                    for who in (("tandem", "vllm") if i % 2 == 0 else ("vllm", "tandem")):
                        time.sleep(1.0)  # let the other side's spinning OpenMP threads go to sleep
                        runs[who] = _timed_generate(eng, reqs) if who == "tandem" else vllm.run(shape)
                    rows.append(_round(i, "tandem", "vllm", runs["tandem"], runs["vllm"]))
                res[shape] = {"rounds": rows, "median_ratio": statistics.median(r["ratio"] for r in rows)}
                print(f"{shape}: tandem / vllm median {res[shape]['median_ratio']:.3f}", flush=True)
    finally:
        vllm.close()
    return res


def _ours_subprocess(args: argparse.Namespace, workload: str, config: dict) -> dict:
    """Each of our runs in a fresh process, like vLLM's, so neither inherits the other's state."""
    code = (f"import json,sys; sys.path.insert(0,{str(ROOT / 'bench')!r}); import throughput as t;"
            f"print(json.dumps(t._ours_entry({args.model!r}, {workload!r}, {args.threads}, {config!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _workload(name: str, vocab: int) -> list[Request]:
    if name == "shared":
        return shared_prefix_workload(num_prefixes=8, prefix_len=1024, questions_per_prefix=16,
                                      vocab_size=vocab, seed=0)
    if name.startswith("batch"):
        n = int(name[5:])
        return throughput_workload(n=n, prompt_len=(32, 64), output_len=(64, 64), vocab_size=vocab, seed=0)
    return named_workload(name, vocab_size=vocab)


def _ours_entry(model: str, workload: str, threads: int, config: dict) -> dict:
    from transformers import AutoConfig

    from tandem.engine.modelgen.resolve import resolve_model

    path = str(resolve_model(model))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    return run_ours(path, _workload(workload, vocab), threads, **config)


def compare_in_process(args: argparse.Namespace, workload: str, a: tuple[str, dict], b: tuple[str, dict]) -> dict:
    """Both engines live in this process and take turns on the same workload, run by
    run: each pair is a second or two apart, so the machine's slow phases (which last
    seconds to minutes here) hit both sides of a ratio alike. The idle engine's
    scheduler thread only polls its queue."""
    from tandem import Engine

    path, vocab = _model(args)
    requests = _workload(workload, vocab)
    engines = {name: Engine(path, **cfg) for name, cfg in (a, b)}
    try:
        for eng in engines.values():
            _warm_up(eng)
        rows = []
        for i in range(args.rounds):
            ra, rb = (_timed_generate(engines[name], requests) for name in (a[0], b[0]))
            rows.append(_round(i, a[0], b[0], ra, rb))
    finally:
        for eng in engines.values():
            eng.shutdown()
    return {"a": a[0], "b": b[0], "rounds": rows, "median_ratio": statistics.median(r["ratio"] for r in rows),
            "protocol": "in-process, alternating run by run"}


def _model(args: argparse.Namespace) -> tuple[str, int]:
    """For a run in this process: torch's thread count set, the model built if needed; (path, vocab)."""
    import torch
    from transformers import AutoConfig

    from tandem.engine.modelgen.resolve import resolve_model

    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    return path, AutoConfig.from_pretrained(path).vocab_size


def _warm_up(eng) -> None:
    eng.generate([[11, 12, 13]] * 2, {"max_new_tokens": 4, "ignore_eos": True})


def _timed_generate(eng, requests: list[Request]) -> dict:
    sps = [{"max_new_tokens": r.max_new_tokens, "temperature": 0, "ignore_eos": True} for r in requests]
    t = time.perf_counter()
    outs = eng.generate([r.prompt_token_ids for r in requests], sps)
    secs = time.perf_counter() - t
    metrics = eng.flush_cache()[0].info.get("metrics", {})  # also empties the prefix cache for the next run
    out_tok = sum(o["meta"]["completion_tokens"] for o in outs)
    cached = sum(o["meta"]["cached_tokens"] for o in outs)
    return {"seconds": secs, "output_tokens": out_tok, "output_tok_per_s": out_tok / secs,
            "cached_tokens": cached, "metrics": metrics}


def _round(i: int, a: str, b: str, ra: dict, rb: dict) -> dict:
    row = {a: ra, b: rb, "ratio": ra["output_tok_per_s"] / rb["output_tok_per_s"], "loadavg_1m": os.getloadavg()[0]}
    print(f"round {i}: {a} {ra['output_tok_per_s']:.0f} tok/s, {b} {rb['output_tok_per_s']:.0f} tok/s, "
          f"ratio {row['ratio']:.3f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["vllm", "overlap", "radix", "overhead"])
    ap.add_argument("--model", default="tiny", help="a preset, a named model, or an HF directory")
    ap.add_argument("--name", default=None, help="result file tag (default: --model's basename)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default="throughput", help=f"vllm: comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--batches", default="64,256", help="overhead: decode batch sizes (1 = the fixed cost a step)")
    args = ap.parse_args()
    args.name = args.name or Path(args.model).name
    base = {"dtype": args.dtype, "page_size": 16, "max_running_requests": 256}
    ours = lambda wl, **kw: (lambda: _ours_subprocess(args, wl, {**base, **kw}))  # noqa: E731
    if args.what == "vllm":
        res = compare_with_vllm(args, base)
    elif args.what == "overlap":
        res = compare_in_process(args, "throughput", ("overlap", {**base, "disable_overlap_schedule": False}),
                                 ("normal", {**base, "disable_overlap_schedule": True}))
    elif args.what == "radix":
        lpm = {**base, "schedule_policy": "lpm"}
        res = {"radix_vs_none": compare_in_process(args, "shared", ("radix", lpm),
                                                   ("no_radix", {**base, "disable_radix_cache": True})),
               "lpm_vs_fcfs": compare_in_process(args, "shared", ("lpm", lpm),
                                                 ("fcfs", {**base, "schedule_policy": "fcfs"}))}
    else:
        sizes = [int(n) for n in args.batches.split(",")]
        res = {f"batch{n}": ours(f"batch{n}", max_running_requests=n)() for n in sizes}
        for name, r in res.items():
            us = r["metrics"].get("overhead_per_req_step_us", 0)
            n = int(name.removeprefix("batch"))
            print(f"{name}: {us:.1f} us per request per decode step, {us * n:.0f} us per step")
    res.update({"model": args.name, "model_dir": args.model, "dtype": args.dtype, "threads": args.threads,
                "loadavg_1m": os.getloadavg()[0]}) if isinstance(res, dict) else None
    tag = f"_b{args.batches.replace(',', '-')}" if args.what == "overhead" and args.batches != "64,256" else ""
    out = ROOT / "docs/results" / f"throughput_{args.what}_{args.name}{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
