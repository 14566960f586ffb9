"""The decode step's matmuls alone: bf16 `x @ W.T` at M = 1..64 rows on the Llama-1B and 8B
shapes, as weight-read bandwidth against a device-to-device copy measured in the same run.

    python bench/small_m_gemm.py                                   # CUDA: both shapes, every form
    python bench/small_m_gemm.py --device cpu --shape tiny --rows 1,2 --iters 3

Why: the first H200 profile (docs/gpu.md) saw qkv_proj and o_proj at about 1.8 TB/s of the
4.2 TB/s a copy reaches, inside a decode graph replay. A small-M matmul only streams its weight,
so time x bandwidth should be the weight's bytes; what it loses is the kernel's fixed cost (its
ramp and tail on 132 SMs) and a cuBLAS heuristic tuned for larger M. Each form below is one
change the engine could make, measured before it is built:

    linear       F.linear(x, W): what the engine runs (cuBLAS, TN)
    cublaslt     the same through cuBLASLt (torch.backends.cuda.preferred_blas_library)
    pretransposed  x @ Wt with Wt = W.T stored contiguous (cuBLAS NN): a load-time re-layout
    fp32_reduce  F.linear with torch's bf16 reduced-precision reductions off, which changes the
                 split-K kernels cuBLAS may pick for a small M (CUDA only)

On CUDA each timing replays a CUDA graph of `--iters` calls, as the decode step runs them,
so launch overhead is out of it; on CPU (the smoke test) it is a plain loop. Output: a table and
a JSON to --out (docs/results/small_m_gemm_<device>.json by default).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, in_features, out_features) of one layer's linears and the LM head, per model shape
SHAPES = {
    "llama-1b": [("qkv_proj", 2048, 3072), ("o_proj", 2048, 2048), ("gate_up_proj", 2048, 16384),
                 ("down_proj", 8192, 2048), ("lm_head", 2048, 128256)],
    "llama-8b": [("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up_proj", 4096, 28672),
                 ("down_proj", 14336, 4096), ("lm_head", 4096, 128256)],
    "tiny": [("qkv_proj", 64, 192), ("o_proj", 64, 64)],
}
FORMS = ("linear", "cublaslt", "pretransposed", "fp32_reduce")
CUDA_ONLY = {"cublaslt", "fp32_reduce"}


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of dst.copy_(src), counting the read and the write (gpu_decode.py's convention)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 5)
    return 2 * nbytes / seconds


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds per call of fn: on CUDA a graph of `iters` calls, replayed and timed by events."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()  # warm
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def form(name: str, x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor) -> Callable[[], torch.Tensor]:
    if name == "pretransposed":
        return lambda: x @ wt
    return lambda: F.linear(x, w)


def measure(device: torch.device, shape: str, rows: list[int], iters: int, dtype: torch.dtype) -> list[dict]:
    results = []
    blas = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    for name, k, n in SHAPES[shape]:
        w = torch.randn(n, k, device=device).to(dtype)
        wt = w.t().contiguous()
        weight_bytes = w.numel() * w.element_size()
        for m in rows:
            x = torch.randn(m, k, device=device).to(dtype)
            for f in FORMS:
                if f in CUDA_ONLY and device.type != "cuda":
                    continue
                reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
                if f == "cublaslt":
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced and f != "fp32_reduce"
                try:
                    seconds = timed(form(f, x, w, wt), device, iters)
                finally:
                    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                    if blas is not None:
                        torch.backends.cuda.preferred_blas_library(blas)
                results.append({"linear": name, "in": k, "out": n, "rows": m, "form": f, "us": seconds * 1e6,
                                "weight_GBps": weight_bytes / seconds / 1e9})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)} (default: llama-1b and llama-8b)")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    shapes = [args.shape] if args.shape else ["llama-1b", "llama-8b"]
    rows = [int(r) for r in args.rows.split(",")]
    copy = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    out = {"device": device.type, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": "bfloat16", "copy_bandwidth_GBps": copy / 1e9,
           "copy_bandwidth_convention": "2 x bytes / time (read + write)", "iters": args.iters, "shapes": {}}
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'shape':10} {'linear':13} {'rows':>4} {'form':14} {'us':>9} {'GB/s':>8} {'% copy':>7}")
    for shape in shapes:
        res = measure(device, shape, rows, args.iters, dtype)
        out["shapes"][shape] = res
        for r in res:
            print(f"{shape:10} {r['linear']:13} {r['rows']:>4} {r['form']:14} {r['us']:9.2f} {r['weight_GBps']:8.0f} "
                  f"{100 * r['weight_GBps'] * 1e9 / copy:6.1f}%")
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    path = Path(args.out or results / f"small_m_gemm_{device.type}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
