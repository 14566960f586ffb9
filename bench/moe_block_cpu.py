"""One mixture-of-experts block on CPU: each expert implementation, against the dense MLP of the
same FLOPs and against the bytes the step must read, side by side in one run.

    python bench/moe_block_cpu.py --dtype bfloat16

The block has the `qwen3-moe-small-shape` preset's proportions (hidden 1024, 32 experts of
width 256, top 4; random weights, random tokens so routing spreads as a trained router's
roughly does). For each batch size T it times, median of --repeats calls each:

    cpu_kernel   the CPU kernel (kernels/csrc/expert_gemm_cpu.cpp), this machine's best level
    grouped      torch's grouped matmul over the pairs sorted by expert (models/expert_mlp.py)
    per_expert   one oneDNN matmul pair per expert that has tokens (the block's first form)
    dense-equal  a dense SwiGLU MLP of width top_k * 256: the same FLOPs a token, the weights
                 of only top_k experts

and reports what the step has to do: FLOPs (2 * T * top_k * 3 * hidden * width) and bytes
(the weights of the experts the batch reaches, which is most of them past a few tokens), with
the achieved GB/s against this machine's read bandwidth (a sum over a 1 GiB tensor).

Results go to docs/results/moe_block_cpu.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, WIDTH, EXPERTS, TOP_K = 1024, 256, 32, 4
BATCHES = (1, 4, 16, 64, 256, 1024)


def _time(fn, x: torch.Tensor, repeats: int) -> float:
    for _ in range(2):
        fn(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth() -> float:
    """GB/s of a sum over 1 GiB: what a weight-streaming step can hope for here."""
    big = torch.ones((1 << 30) // 4, dtype=torch.float32)
    t = _time(lambda _: big.sum(), big, 5)
    return big.numel() * big.element_size() / t / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "moe_block_cpu.json")
    args = ap.parse_args()

    from tandem.engine.models import expert_mlp
    from tandem.engine.models.moe import SparseMoE

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    moe = SparseMoE(HIDDEN, WIDTH, EXPERTS, TOP_K, renormalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    moe = moe.to(dtype)
    dense_gate_up = torch.randn(2 * TOP_K * WIDTH, HIDDEN, generator=g).to(dtype) * 0.02
    dense_down = torch.randn(HIDDEN, TOP_K * WIDTH, generator=g).to(dtype) * 0.02

    def dense(x: torch.Tensor) -> torch.Tensor:
        return F.linear(moe.ops.silu_and_mul(F.linear(x, dense_gate_up)), dense_down)

    def form(how: str):
        def run(x: torch.Tensor) -> torch.Tensor:
            chosen = expert_mlp.choose
            expert_mlp.choose = lambda *_: how
            try:
                return moe(x)
            finally:
                expert_mlp.choose = chosen
        return run

    bw = read_bandwidth()
    width = torch.finfo(dtype).bits // 8
    expert_bytes = 3 * HIDDEN * WIDTH * width
    result: dict = {"dtype": args.dtype, "read_gb_s": round(bw, 1), "shape": {
        "hidden": HIDDEN, "expert_width": WIDTH, "experts": EXPERTS, "top_k": TOP_K}, "batches": {}}
    print(f"read bandwidth {bw:.1f} GB/s", flush=True)
    with torch.inference_mode():
        for t in BATCHES:
            x = torch.randn(t, HIDDEN, generator=g).to(dtype)
            reached = len(torch.unique(moe.route(x)[1]))
            nbytes = reached * expert_bytes + EXPERTS * HIDDEN * width
            flops = 2 * t * TOP_K * 3 * HIDDEN * WIDTH
            row: dict = {"experts_reached": reached, "mbytes": round(nbytes / 1e6, 1), "mflop": round(flops / 1e6, 1)}
            for name, fn in (("cpu_kernel", form("cpu_kernel")), ("grouped", form("grouped")),
                             ("per_expert", form("per_expert")), ("dense_equal", dense)):
                s = _time(fn, x, args.repeats)
                moved = TOP_K * expert_bytes if name == "dense_equal" else nbytes
                row[name] = {"ms": round(s * 1e3, 3), "gb_s": round(moved / s / 1e9, 1),
                             "gflop_s": round(flops / s / 1e9, 1)}
            row["kernel_vs_per_expert"] = round(row["per_expert"]["ms"] / row["cpu_kernel"]["ms"], 2)
            row["kernel_vs_dense_equal"] = round(row["dense_equal"]["ms"] / row["cpu_kernel"]["ms"], 2)
            row["chosen"] = expert_mlp.choose(x.device, dtype, t * TOP_K, EXPERTS, HIDDEN, WIDTH)
            result["batches"][t] = row
            print(t, row, flush=True)
    result["meta"] = run_meta(torch.device("cpu"))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
