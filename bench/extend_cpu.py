"""Extend (prefill) attention on CPU: the paged kernel's AMX and fp32-FMA forms vs the
per-request SDPA path it replaced, alternated round by round in one process.

    python bench/extend_cpu.py                       # attention of one layer, bf16
    python bench/extend_cpu.py --forward small       # a whole prefill forward of the model
    python bench/extend_cpu.py --forward small --profile   # and where its time goes (torch profiler)

Attention cases (16 requests, bf16, head_dim 64): new prompts of 32-256 tokens, and
short questions (16-61 tokens) on 1,024 cached tokens each, where SDPA also gathers
the prefix and builds a mask. Heads: the small model's 16/4 and the tiny model's 4/2.
The forward case prefills 16 prompts of 32-256 tokens through the ModelRunner. Each
figure is the median over rounds of SDPA's time / the variant's time in that round.
Results go to docs/results/extend_cpu.json (extend_cpu_forward_<model>.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool

VARIANTS = ("amx", "fma", "sdpa")  # (use_extend_kernel, use_amx) below


def _set(backend: TorchAttentionBackend, variant: str) -> None:
    backend.use_extend_kernel, backend.use_amx = variant != "sdpa", variant == "amx"


def _attention_case(heads: int, kv_heads: int, prefix: int, extends: list[int]):
    """A backend on a one-layer pool holding every request's prefix, and an EXTEND batch."""
    dim, dtype = 64, torch.bfloat16
    total = sum(prefix + e for e in extends)
    ctx = SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(len(extends), prefix + max(extends), "cpu"),
        kv_pool=TokenToKVPool(total + 1, 1, 1, kv_heads, dim, dtype, "cpu"),
        device=torch.device("cpu"), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        scaling=dim**-0.5, dtype=dtype, page_size=1,
    )
    ctx.kv_pool.kv_buffer[:, :, 1:].normal_()
    rows = ctx.req_to_token_pool.alloc(len(extends))
    new = []
    for row, e in zip(rows, extends, strict=True):
        slots = ctx.kv_pool.allocator.alloc(prefix + e)
        ctx.req_to_token_pool.write(row, 0, slots)
        new.append(slots[prefix:])
    n = sum(extends)
    batch = ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(n, dtype=torch.int64), rows, [prefix] * len(extends),
                               extends, torch.cat(new), "cpu")
    q = torch.randn(n, heads, dim, dtype=dtype)
    k = torch.randn(n, kv_heads, dim, dtype=dtype)
    backend = TorchAttentionBackend(ctx)

    def step(variant: str) -> None:
        _set(backend, variant)
        backend.init_forward_metadata(batch)
        backend.forward(q, k, torch.randn_like(k), 0, batch)

    return step


def _forward_case(model: str):
    from tandem.engine.model_config import RunnerConfig
    from tandem.engine.modelgen.resolve import resolve_model
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.runner.static_generate import StaticBatch

    runner = ModelRunner.load(str(resolve_model(model)), RunnerConfig(dtype="bfloat16", page_size=16,
                                                                 max_total_tokens=8192, max_running_requests=16))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, runner.vocab_size) for _ in range(rng.randint(32, 256))] for _ in range(16)]
    sb = StaticBatch(runner)

    def step(variant: str) -> None:
        _set(runner.attn_backend, variant)
        seqs = sb.new(len(prompts))
        sb.forward(seqs, prompts)
        sb.release(seqs)

    return step


@torch.inference_mode()
def _compare(step, rounds: int) -> dict:
    for v in VARIANTS:
        step(v)  # warm-up (and the kernels' first build)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            t = time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t)
    out = {f"{v}_ms": statistics.median(times[v]) * 1e3 for v in VARIANTS}
    for v in ("amx", "fma"):
        out[f"sdpa_over_{v}"] = statistics.median(s / x for s, x in zip(times["sdpa"], times[v]))
    out["fma_over_amx"] = statistics.median(f / a for f, a in zip(times["fma"], times["amx"]))
    return out


@torch.inference_mode()
def _profile(step) -> None:
    from torch.profiler import profile

    step("amx")
    with profile() as prof:
        for _ in range(3):
            step("amx")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forward", metavar="MODEL", help="time a whole prefill forward of this model instead")
    ap.add_argument("--profile", action="store_true", help="with --forward: print the op profile of the AMX variant")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    fresh = [rng.randint(32, 256) for _ in range(16)]
    questions = [16 + 3 * i for i in range(16)]
    if args.forward:
        cases = {f"forward {args.forward}, 16 x 32-256 tokens": _forward_case(args.forward)}
    else:
        shapes = (("16 x 32-256 new", 0, fresh), ("16 x (1024 cached + 16-61 new)", 1024, questions))
        cases = {f"{h}/{kv} heads, {label}": _attention_case(h, kv, prefix, ext)
                 for h, kv in ((16, 4), (4, 2)) for label, prefix, ext in shapes}
    if args.profile and args.forward:
        _profile(next(iter(cases.values())))
    res = {}
    for name, step in cases.items():
        res[name] = r = _compare(step, args.rounds)
        print(f"{name}: amx {r['amx_ms']:.2f} ms, fma {r['fma_ms']:.2f} ms, sdpa {r['sdpa_ms']:.2f} ms; sdpa/amx "
              f"{r['sdpa_over_amx']:.2f}x, sdpa/fma {r['sdpa_over_fma']:.2f}x, fma/amx {r['fma_over_amx']:.2f}x",
              flush=True)
    name = f"extend_cpu_forward_{args.forward}.json" if args.forward else "extend_cpu.json"
    out = Path(__file__).resolve().parent.parent / "docs/results" / name
    out.write_text(json.dumps({"rounds": args.rounds, "threads": args.threads, "cases": res}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
