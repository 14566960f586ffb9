"""Where a prefill's time goes, ours beside HF's: the kernels of one Engine prefill and of one HF
forward of the same prompts, in one run, grouped by kind.

    python bench/prefill_profile.py --model llama-1b-shape --prefill 8x2048      # CUDA
    python bench/prefill_profile.py --model tiny --device cpu --prefill 2x32      # CPU smoke

gpu_decode.py measured the Engine's 8x2048 prefill at 0.75x of HF's forward on an H200. This
says which kernels make the difference: each side runs once to warm up, then once under the
torch profiler. On CUDA a row is a kernel (GPU time); on CPU, where only the smoke test runs it,
an operator (self CPU time). Kinds: matmul, attention, norm/rope/act (the layer ops), copy/index,
sampling, other. Output: both tables, the per-kind sums and the wall times, to --out as JSON, with what ran
(run_meta.py).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_decode import engine_args, flush, prompts_for, resolve, sp, timed
from run_meta import run_meta

KINDS = [  # first match wins; patterns over kernel (CUDA) or operator (CPU) names
    ("attention", r"flashinfer::Batch|Prefill|Decode|MergeStates|flash|fmha|attention|sdpa|paged"),
    ("matmul", r"gemm|panel_linear|nvjet|cutlass|xmma|sm90_|ampere|cublas|aten::(mm|addmm|linear|matmul|bmm)|mkldnn"),
    ("norm/rope/act", r"norm|rope|Rotary|silu|act_and_mul|rsqrt|Mean|pow|layer_ops|rms"),
    ("sampling", r"argmax|softmax|topk|sort|gumbel|sampl|exponential"),
    ("copy/index", r"copy|Copy|index|Index|gather|scatter|cat|Cat|embedding|fill|to_copy|clone"),
]


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name)), "other")


def profiled(fn: Callable[[], Any], device: torch.device, top: int) -> dict[str, Any]:
    """Wall ms of fn (synchronised) and its kernels: the top rows by time, and sums per kind."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    # On CPU the Engine's operators run on its scheduler thread: follow every thread.
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU],
                 experimental_config=None if cuda else every_thread) as prof:
        wall, _ = timed(fn, device)
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key[:100], "kind": kind(e.key), "calls": e.count, "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    kinds: dict[str, float] = defaultdict(float)
    for r in rows:
        kinds[r["kind"]] += r["ms"]
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(kinds.values()), "kinds": dict(kinds), "top": rows[:top]}


def show(name: str, res: dict[str, Any]) -> None:
    print(f"\n== {name}: wall {res['wall_ms']:.1f} ms, kernels {res['kernel_ms']:.1f} ms")
    for k, ms in sorted(res["kinds"].items(), key=lambda kv: -kv[1]):
        print(f"   {k:<14} {ms:9.2f} ms")
    for r in res["top"]:
        print(f"   {r['ms']:9.2f} ms {r['calls']:6d}x  [{r['kind']}] {r['name']}")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b-shape")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--prefill", default="8x2048")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from tandem import Engine

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    path = resolve(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
    n, length = (int(x) for x in args.prefill.lower().split("x"))
    prompts = prompts_for(n, length, hf.config.vocab_size, seed=12345)
    ids = torch.tensor(prompts, device=device)
    hf_forward = lambda: hf(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
    eargs = {"device": device.type, "dtype": dtype, **engine_args(args.engine_arg)}
    with Engine(str(path), **eargs) as eng:
        ours = lambda: eng.generate(prompts, sp(1))  # noqa: E731
        flush(eng)
        ours()
        hf_forward()
        flush(eng)  # an empty prefix cache: the whole prompt is computed
        res = {"model": args.model, "prefill": args.prefill, "device": str(device), "dtype": dtype,
               "engine_args": eargs, "engine": profiled(ours, device, args.top),
               "hf": profiled(hf_forward, device, args.top), "meta": run_meta(device, eng)}
    res["hf_over_engine_wall"] = res["hf"]["wall_ms"] / res["engine"]["wall_ms"]
    show("ours (Engine, generate 1 token)", res["engine"])
    show("HF forward (logits_to_keep=1)", res["hf"])
    print(f"\nhf/engine wall: {res['hf_over_engine_wall']:.2f} (>= 1: ours faster)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
