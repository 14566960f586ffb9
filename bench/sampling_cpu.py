"""Seeded sampling per decode step on CPU: the fused Gumbel-max kernel vs the torch ops.

    python bench/sampling_cpu.py [--batch 64] [--vocabs 8192 151936] [--rounds 9]

Both paths draw the same tokens (tests/engine/test_sampler.py); rounds alternate them and
the figure is the median of the per-round ratios. Temperature 0.8; no filter, then
top-p 0.95, then top-k 50 (the torch path sorts the vocab, the kernel bisects).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.runner.sampler import SamplingBatch, sample
from tandem.engine.sampling_params import SamplingParams


def _ms(fn, n: int = 5) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def _case(batch: int, vocab: int, rounds: int, filters: dict) -> dict:
    logits = torch.randn(batch, vocab) * 3
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=i, **filters) for i in range(batch)],
                                   vocab, "cpu")
    pos = torch.arange(batch)
    real_enabled = cpu_kernels.enabled

    def kernel() -> None:
        sample(logits, sb, pos)

    def torch_ops() -> None:
        cpu_kernels.enabled = lambda op: False
        try:
            sample(logits, sb, pos)
        finally:
            cpu_kernels.enabled = real_enabled

    kernel(), torch_ops()
    k_ms, t_ms = [], []
    for _ in range(rounds):
        k_ms.append(_ms(kernel))
        t_ms.append(_ms(torch_ops))
    return {"batch": batch, "vocab": vocab, "filters": filters,
            "kernel_ms": statistics.median(k_ms), "torch_ms": statistics.median(t_ms),
            "torch_over_kernel": statistics.median(t / k for t, k in zip(t_ms, k_ms))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[8192, 151936])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/sampling_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    rows = []
    for vocab in args.vocabs:
        for filters in ({}, {"top_p": 0.95}, {"top_k": 50}):
            rows.append(_case(args.batch, vocab, args.rounds, filters))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "threads": args.threads}, indent=2))


if __name__ == "__main__":
    main()
