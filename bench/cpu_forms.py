"""Each CPU kernel form against torch's own path, per op, on the machine it runs on.

For every kernel level this CPU executes (cpu_plan.levels_supported) and every op the
plan switches (cpu_plan.OPS), the same call runs through the level's kernel and through
torch's path, alternating, and the figure is the median of the per-round ratios
torch / kernel (> 1: the kernel is faster). cpu_plan._TORCH_FASTER records the ops a
level leaves on torch because of these figures.

    python bench/cpu_forms.py [--rounds 7] [--dtype bfloat16] [--out docs/results/cpu_forms.json]

To see what an AVX2 CPU's torch would do, cap torch too (our levels are chosen per run):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_forms.py --levels avx2 generic

Shapes: the small model's attention (16 q / 4 kv heads, head_dim 64), decode of 32
requests x 512 context and a prefill of 4 x 256 tokens; the layer ops of one small-model
layer on 32 rows (decode) and 1024 rows (prefill); sampling of 32 rows x 16k vocab, seeded,
top-p 0.95.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kernels import cpu_kernels, cpu_plan
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.models.layer_ops import TORCH, CpuKernelOps
from tandem.engine.models.layers import RMSNorm
from tandem.engine.runner.sampler import SamplingBatch, sample
from tandem.engine.sampling_params import SamplingParams

HEADS, KV_HEADS, DIM, HIDDEN, INTER = 16, 4, 64, 1024, 2816


def _attention_case(mode: ForwardMode, dtype: torch.dtype) -> Callable[[bool], Callable[[], object]]:
    reqs = [(511, 1)] * 32 if mode == ForwardMode.DECODE else [(0, 256)] * 4  # (prefix, new)
    ctx = SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(len(reqs), 512, "cpu"),
        kv_pool=TokenToKVPool(sum(p + n for p, n in reqs) // 16 + 2, 16, 1, KV_HEADS, DIM, dtype, "cpu"),
        device=torch.device("cpu"), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
        scaling=DIM**-0.5, dtype=dtype, page_size=16,
    )
    ctx.kv_pool.kv_buffer.normal_()
    rows = ctx.req_to_token_pool.alloc(len(reqs))
    locs = []
    for row, (p, n) in zip(rows, reqs, strict=True):
        slots = ctx.kv_pool.allocator.alloc(p + n)
        ctx.req_to_token_pool.write(row, 0, slots)
        locs.append(slots[p:])
    tokens = sum(n for _, n in reqs)
    batch = ForwardBatch.build(mode, torch.zeros(tokens, dtype=torch.int64), rows, [p for p, _ in reqs],
                               [n for _, n in reqs], torch.cat(locs), "cpu",
                               num_extend_reqs=0 if mode == ForwardMode.DECODE else len(reqs))
    q = torch.randn(tokens, HEADS, DIM, dtype=dtype)
    k = torch.randn(tokens, KV_HEADS, DIM, dtype=dtype)

    def make(kernel: bool) -> Callable[[], object]:
        be = TorchAttentionBackend(ctx)
        be.use_decode_kernel = be.use_extend_kernel = kernel

        def run() -> object:
            be.init_forward_metadata(batch)
            return be.forward(q, k, k, 0, batch)
        return run
    return make


def _layer_ops_case(rows: int, dtype: torch.dtype) -> Callable[[bool], Callable[[], object]]:
    norm = RMSNorm(HIDDEN, 1e-6).to(dtype)
    x, res = torch.randn(rows, HIDDEN, dtype=dtype), torch.randn(rows, HIDDEN, dtype=dtype)
    gate_up = torch.randn(rows, 2 * INTER, dtype=dtype)

    def make(kernel: bool) -> Callable[[], object]:
        def run() -> object:  # a layer's elementwise work: two norms (one fused with the add), SiLU*mul
            norm.ops = CpuKernelOps() if kernel else TORCH
            norm(x)
            norm.add_forward(x.clone(), res.clone())
            if kernel:
                return cpu_kernels.silu_and_mul(gate_up)
            g, u = gate_up.chunk(2, -1)
            return torch.nn.functional.silu(g) * u
        return run
    return make


def _store_case(dtype: torch.dtype) -> Callable[[bool], Callable[[], object]]:
    pool = TokenToKVPool(257, 16, 1, KV_HEADS, DIM, dtype, "cpu")
    k = torch.randn(32, KV_HEADS, DIM, dtype=dtype)
    loc = torch.randperm(4096 - 16)[:32] + 16

    def make(kernel: bool) -> Callable[[], object]:
        pool._store = cpu_kernels.store_kv if kernel else None
        return lambda: pool.set_kv(0, loc, k, k)
    return make


def _sampling_case() -> Callable[[bool], Callable[[], object]]:
    vocab = 16384
    logits = torch.randn(32, vocab) * 3
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(32)],
                                   vocab, "cpu")
    pos = torch.arange(32)

    def make(kernel: bool) -> Callable[[], object]:
        def run() -> object:
            real = cpu_kernels.enabled
            cpu_kernels.enabled = lambda op: kernel  # type: ignore[assignment]
            try:
                return sample(logits, sb, pos)
            finally:
                cpu_kernels.enabled = real  # type: ignore[assignment]
        return run
    return make


def _cases(dtype: torch.dtype) -> dict[str, Callable[[bool], Callable[[], object]]]:
    return {
        "decode_attention": _attention_case(ForwardMode.DECODE, dtype),
        "extend_attention": _attention_case(ForwardMode.EXTEND, dtype),
        "layer_ops (decode rows)": _layer_ops_case(32, dtype),
        "layer_ops (prefill rows)": _layer_ops_case(1024, dtype),
        "store_kv": _store_case(dtype),
        "sampling": _sampling_case(),
    }


def _ms(fn: Callable[[], object], reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def measure(level: str, dtype: torch.dtype, rounds: int) -> dict[str, dict[str, float]]:
    out = {}
    with cpu_kernels.forced(level), torch.inference_mode():
        for name, make in _cases(dtype).items():
            kern, ref = make(True), make(False)
            kern(), ref()  # warm-up (and the build, the first time)
            reps = max(1, int(20 / max(_ms(ref, 1), 0.05)))  # ~20 ms a timing
            ratios, k_ms, t_ms = [], [], []
            for r in range(rounds):
                order = [(kern, k_ms), (ref, t_ms)][:: 1 if r % 2 == 0 else -1]
                for fn, acc in order:
                    acc.append(_ms(fn, reps))
                ratios.append(t_ms[-1] / k_ms[-1])
            out[name] = {"kernel_ms": statistics.median(k_ms), "torch_ms": statistics.median(t_ms),
                         "torch_over_kernel": statistics.median(ratios)}
            print(f"{level:12s} {name:26s} kernel {out[name]['kernel_ms']:8.3f} ms  torch "
                  f"{out[name]['torch_ms']:8.3f} ms  torch/kernel {out[name]['torch_over_kernel']:5.2f}x", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", nargs="*", help="default: every level this CPU executes")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    supported = cpu_plan.levels_supported(cpu_plan.read_cpu_flags())
    levels = args.levels or list(supported)
    dtype = getattr(torch, args.dtype)
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpu_levels": list(supported),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "rounds": args.rounds,
        "levels": {lv: measure(lv, dtype, args.rounds) for lv in levels},
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
