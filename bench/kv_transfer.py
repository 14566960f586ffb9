"""KV transfer bandwidth between two processes (NIXL WRITE over UCX) against a copy of the
same bytes inside one process, alternating round by round: on CPU memory against memcpy, on
a GPU (`--device cuda`, both processes on one GPU, VRAM to VRAM) against a device-to-device copy.

    python bench/kv_transfer.py --rounds 7                  # 4096-token prompts
    python bench/kv_transfer.py --tokens 1024 --scattered   # 1k tokens, pages scattered
    python bench/kv_transfer.py --device cuda               # -> docs/results/kv_transfer_cuda.json
    python bench/kv_transfer.py --decode-heads 0:2          # to a TP rank holding half the KV heads
    python bench/kv_transfer.py --decode-heads 0:2 --staged # the same, gathered into whole pages first

The KV layout is the `small` model's (12 layers, 4 KV heads, head_dim 64, bf16) with
page size 16. One send moves a whole prompt: every layer's K and V of tokens/16 pages,
consecutive (as a fresh allocation usually is) or scattered (`--scattered`). The baseline
copies the same number of bytes between two tensors of this process: on CPU `memcpy` on one
thread (what memcpy(3) does, and what NIXL's one UCX worker competes with), and torch's
copy on all threads (2 here) for reference; on CUDA one `copy_` between two device tensors,
synchronised, for both columns. With --decode-heads each token's slice is its own descriptor;
--staged gathers the slice into staging pages of the sender's pool first (prefill/staging.py,
as a TP 1 prefill sends to a TP 2 decode; the sources then come from the pool's lower half,
which requests hold), and the gather's time counts as the send's.
Result: docs/results/kv_transfer[_scattered][_heads[_staged]][_cuda].json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.pd.transfer.nixl_agent import NixlTransfer
from tandem.prefill.staging import SliceStaging
from tandem.protocol.kv_layout import KVLayout

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(page_size=16, num_layers=12, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)


def _pool(num_pages: int, device: str, heads: tuple[int, int] | None) -> TokenToKVPool:
    """The small model's pool, or (heads) a TP rank's shard of its KV heads."""
    if heads is None:
        return TokenToKVPool(num_pages=num_pages, device=device, **SHAPE)
    shape = {**SHAPE, "num_kv_heads": heads[1] - heads[0]}
    return TokenToKVPool(num_pages=num_pages, device=device, heads=heads, total_kv_heads=SHAPE["num_kv_heads"],
                         **shape)


def _receiver(conn, num_pages: int, device: str, heads: tuple[int, int] | None) -> None:
    dst = _pool(num_pages, device, heads)
    t = NixlTransfer("bench-decode")
    conn.send((t.register(dst.layout()), dst.layout().to_dict()))
    peer_meta, peer_layout = conn.recv()
    t.add_peer(peer_meta, KVLayout(**peer_layout))
    while not conn.poll(0):  # the receiving side polls too (that drives its progress), as a
        t.poll()             # decode scheduler does once per loop iteration: not a spinning core
        time.sleep(0.0002)
    conn.recv()
    t.close()


def main() -> None:
    p = argparse.ArgumentParser()
    # 4096 tokens = 48 MiB a send: past the L3 cache, so memcpy runs at memory speed too.
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sends", type=int, default=20, help="sends per round (one prompt each)")
    p.add_argument("--scattered", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--decode-heads", default=None, metavar="LO:HI",
                   help="the receiver holds only KV heads [LO, HI) of 4, as a decode TP rank whose TP size "
                        "differs from prefill's: each token's slice is its own descriptor (docs/tp.md)")
    p.add_argument("--staged", action="store_true", help="with --decode-heads: gather each send's slice into "
                   "staging pages of the sender's pool first, as the prefill role does (prefill/staging.py)")
    p.add_argument("--out", default=None, help="default docs/results/kv_transfer[_scattered][_heads][_cuda].json")
    args = p.parse_args()
    heads = tuple(int(x) for x in args.decode_heads.split(":")) if args.decode_heads else None
    if args.staged and heads is None:
        p.error("--staged needs --decode-heads")
    cuda = args.device == "cuda"
    n = args.tokens // SHAPE["page_size"]
    num_pages = 8 * n + 1
    src = TokenToKVPool(num_pages=num_pages, device=args.device, **SHAPE)
    src.kv_buffer.normal_()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, num_pages, args.device, heads))
    proc.start()
    t = NixlTransfer("bench-prefill", timeout=120)
    meta = t.register(src.layout())
    peer_meta, peer_layout = here.recv()
    peer = t.add_peer(peer_meta, KVLayout(**peer_layout))
    here.send((meta, src.layout().to_dict()))
    rng = random.Random(0)
    layout = src.layout()
    staging = None
    if args.staged:
        table = ReqToTokenPool(4, 64, "cpu")
        staging = SliceStaging(CacheManager(table, src, create_prefix_cache(False, table, src.allocator, 16)))
        src.allocator.alloc_pages(num_pages // 2)  # the sources' half; staging takes pages of the other
    nbytes = n * layout.page_bytes * 2 * layout.num_layers
    if heads is not None:  # only the receiver's share of every page moves
        nbytes = nbytes * (heads[1] - heads[0]) // SHAPE["num_kv_heads"]
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device)
    b = torch.empty_like(a)
    a.normal_()

    def pages() -> tuple[list[int], list[int]]:
        top = num_pages // 2 if args.staged else num_pages
        if args.scattered:
            return rng.sample(range(1, top), n), rng.sample(range(1, num_pages), n)
        s, d = rng.randrange(1, top - n), rng.randrange(1, num_pages - n)
        return list(range(s, s + n)), list(range(d, d + n))

    def nixl_round(staged: bool = args.staged, sends: int = args.sends) -> float:
        t0 = time.perf_counter()
        for i in range(sends):
            sp, dp = pages()
            source = None
            if staged:
                got = staging.stage(f"r{i}", sp, heads)
                assert got is not None, "no room for staging"
                source, sp = got
            t.send(peer, f"r{i}", sp, dp, b"", heads=heads, source=source)
            while not (ev := t.poll()).sent:
                pass
            assert ev.sent[0].ok, ev.sent
            if staged:
                staging.release(f"r{i}")
        return sends * nbytes / (time.perf_counter() - t0)

    def memcpy_round(threads: int) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            for _ in range(args.sends):
                b.copy_(a)
                if cuda:  # one send is waited for before the next, as NIXL's are
                    torch.cuda.synchronize()
            return args.sends * nbytes / (time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)

    all_threads = torch.get_num_threads()
    nixl_round(), memcpy_round(1)  # warm-up
    rows = []
    try:
        for r in range(args.rounds):
            x, y, z = nixl_round(), memcpy_round(1), memcpy_round(all_threads)
            rows.append({"round": r, "nixl_GBps": x / 1e9, "memcpy_GBps": y / 1e9, "copy_all_threads_GBps": z / 1e9,
                         "ratio": x / y, "ratio_all_threads": x / z})
            if args.staged:  # the same slices sent where they lie, in the same round (a few sends: they are slow)
                w = nixl_round(staged=False, sends=max(1, args.sends // 10))
                rows[-1] |= {"slices_GBps": w / 1e9, "staged_over_slices": x / w}
            print(json.dumps({k: round(v, 3) for k, v in rows[-1].items()}), flush=True)
    finally:
        here.send("stop")
        t.close()
        proc.join(30)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "tokens": args.tokens, "bytes_per_send": nbytes, "scattered": args.scattered, "decode_heads": heads,
              "staged": args.staged,
              "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0], "rounds": rows,
              "median_ratio": statistics.median(r["ratio"] for r in rows),
              "median_ratio_all_threads": statistics.median(r["ratio_all_threads"] for r in rows)}
    if args.staged:
        result["median_staged_over_slices"] = statistics.median(r["staged_over_slices"] for r in rows)
    tag = (f"{'_scattered' if args.scattered else ''}{'_heads' if heads else ''}{'_staged' if args.staged else ''}"
           f"{'_cuda' if cuda else ''}")
    out = Path(args.out) if args.out else ROOT / f"docs/results/kv_transfer{tag}.json"
    out.write_text(json.dumps(result, indent=1))
    base = "device copy" if cuda else "memcpy"
    print(f"NIXL / {base} bandwidth, median of {args.rounds} rounds: {result['median_ratio']:.2f} "
          f"(vs torch's {all_threads}-thread copy: {result['median_ratio_all_threads']:.2f}) -> {out}")
    if args.staged:
        print(f"staged / the same slices sent as they lie: {result['median_staged_over_slices']:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
