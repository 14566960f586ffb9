"""Decode attention per layer on CPU: fused paged kernel vs gather + SDPA.

Both paths run through TorchAttentionBackend._decode on the same 12-layer paged
pool (the small Llama shape: 16 q heads, 4 kv heads, head_dim 64, bf16), so the
K/V of one step (12 layers) is larger than the caches a layer would hit in
isolation. Slots follow page_size=1 decode allocation: each step hands one slot
to every running request, so request b's position t sits at slot 1 + t*B + b.
Rounds alternate the two paths; the machine is shared, so we print min and
median over rounds. Under heavy load from other jobs, 2-thread wall times mostly
measure OpenMP fork/join stalls; `--threads 1 --clock thread` (CPU time of the
one working thread) then gives the steadier comparison.

    python bench/attention_cpu.py [--batches 1 16 64] [--ctx 256] [--rounds 15]
    python bench/attention_cpu.py --threads 1 --clock thread
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kernels import cpu_kernels
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool

LAYERS, HEADS, KV_HEADS, DIM = 12, 16, 4, 64


def _setup(batch: int, ctx_len: int, dtype: torch.dtype, layout: str):
    num_slots = batch * ctx_len + 1  # + the reserved page 0 (page_size 1)
    kv = TokenToKVPool(num_slots, 1, LAYERS, KV_HEADS, DIM, dtype, "cpu")
    kv.kv_buffer[:, :, 1:].normal_()
    r2t = ReqToTokenPool(batch, ctx_len, "cpu")
    pos = torch.arange(ctx_len)
    for b in range(batch):
        r2t.req_to_token[b] = 1 + pos * batch + b  # interleaved, as decode steps allocate
    if layout == "random":
        perm = torch.randperm(num_slots - 1, dtype=torch.int32) + 1
        r2t.req_to_token.copy_(perm[(r2t.req_to_token - 1).long()])
    ctx = SimpleNamespace(
        req_to_token_pool=r2t,
        kv_pool=kv,
        device=torch.device("cpu"),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        scaling=DIM**-0.5,
        dtype=dtype,
        page_size=1,
    )
    # a decode step whose new token is position ctx_len - 1 (its slot is already filled)
    fb = ForwardBatch.build(
        ForwardMode.DECODE,
        torch.zeros(batch, dtype=torch.int64),
        list(range(batch)),
        [ctx_len - 1] * batch,
        [1] * batch,
        r2t.req_to_token[:, -1].long(),
        "cpu",
    )
    q = torch.randn(batch, HEADS, DIM, dtype=dtype)
    return ctx, fb, q


def _time_step(
    backend: TorchAttentionBackend, fb: ForwardBatch, q: torch.Tensor, clock=time.perf_counter
) -> tuple[float, float]:
    """(metadata ms per step, attention ms per layer) for one decode step over all layers."""
    t0 = clock()
    backend.init_forward_metadata(fb)
    t1 = clock()
    for layer in range(LAYERS):
        backend._decode(q, layer, fb.attn_metadata)
    t2 = clock()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--layout", choices=["interleaved", "random"], default="interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of this thread (needs --threads 1); steady on a shared machine",
    )
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        raise SystemExit("--clock thread measures one thread: use --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    if not cpu_kernels.available():
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    print(
        f"kernel load {time.perf_counter() - t0:.1f}s | threads {torch.get_num_threads()} | {args.dtype} "
        f"| Hq {HEADS} Hkv {KV_HEADS} D {DIM} | ctx {args.ctx} | {LAYERS} layers | {args.layout} slots "
        f"| {args.clock} clock"
    )
    head = ("batch", "kernel ms", "gather+sdpa ms", "ratio", "meta/step ms", "max err")
    print("{:>5} {:>15} {:>15} {:>11} {:>13} {:>8}".format(*head))
    for batch in args.batches:
        ctx, fb, q = _setup(batch, args.ctx, dtype, args.layout)
        fused, gather = TorchAttentionBackend(ctx), TorchAttentionBackend(ctx)
        assert fused.use_decode_kernel
        gather.use_decode_kernel = False
        # agreement check on layer 0 (also the warm-up)
        fused.init_forward_metadata(fb)
        a = fused._decode(q, 0, fb.attn_metadata)
        gather.init_forward_metadata(fb)
        err = (a.float() - gather._decode(q, 0, fb.attn_metadata).float()).abs().max().item()
        res: dict[str, list[tuple[float, float]]] = {"k": [], "g": []}
        for r in range(args.rounds + 2):
            for name, be in (("k", fused), ("g", gather)) if r % 2 else (("g", gather), ("k", fused)):
                m = _time_step(be, fb, q, clock)
                if r >= 2:
                    res[name].append(m)
        k_att, g_att = [x[1] for x in res["k"]], [x[1] for x in res["g"]]
        k_meta, g_meta = (statistics.median(x[0] for x in res[n]) for n in "kg")
        km, gm = statistics.median(k_att), statistics.median(g_att)
        print(
            f"{batch:>5} {min(k_att):6.3f} /{km:7.3f} {min(g_att):6.3f} /{gm:7.3f} "
            f"{min(g_att) / min(k_att):5.2f}/{gm / km:5.2f} {k_meta:6.2f}/{g_meta:6.2f} {err:8.1e}"
        )
    print("ms: min / median per layer over rounds; ratio: gather / kernel, of the mins / of the medians;")
    print("meta: init_forward_metadata per step, kernel / gather")


if __name__ == "__main__":
    main()
