"""KV transfer bandwidth between two processes (NIXL WRITE over UCX) against a copy of the
same bytes inside one process, alternating round by round: on CPU memory against memcpy, on
a GPU (`--device cuda`, both processes on one GPU, VRAM to VRAM) against a device-to-device copy.

    python bench/kv_transfer.py --rounds 7                  # 4096-token prompts
    python bench/kv_transfer.py --tokens 1024 --scattered   # 1k tokens, pages scattered
    python bench/kv_transfer.py --device cuda               # -> docs/results/kv_transfer_cuda.json
    python bench/kv_transfer.py --decode-heads 0:2          # to a TP rank holding half the KV heads
    python bench/kv_transfer.py --decode-heads 0:2 --staged # the same, gathered into whole pages first
    python bench/kv_transfer.py --prefill-heads 0:2 --staged   # half the heads into a rank holding all

The KV layout is the `small` model's (12 layers, 4 KV heads, head_dim 64, bf16) with
page size 16. One send moves a whole prompt: every layer's K and V of tokens/16 pages,
consecutive (as a fresh allocation usually is) or scattered (`--scattered`). The baseline
copies the same number of bytes between two tensors of this process: on CPU `memcpy` on one
thread (what memcpy(3) does, and what NIXL's one UCX worker competes with), and torch's
copy on all threads (2 here) for reference; on CUDA one `copy_` between two device tensors,
synchronised, for both columns.

Between TP sizes (docs/tp.md) a send moves a slice of each token's heads, each token's its own
descriptor where it lies. --decode-heads: the receiver holds the slice (prefill TP 1 -> decode
TP 2); --staged gathers it into staging pages of the sender's pool first (prefill/staging.py),
and the gather counts as the send's time. --prefill-heads: the sender holds the slice and the
receiver all heads (prefill TP 2 -> decode TP 1); the receiver acks every send, and --staged
sends into its staging pages, which it moves into place before the ack (decode/staging.py).
With --staged the pools' lower half holds the requests' pages, the upper half staging, and
each round also times a few sends of the same slices where they lie.
Result: docs/results/kv_transfer[_scattered][_heads|_to_wider][_staged][_cuda].json, with what ran
(run_meta.py: the GPU, NIXL's version, the commit) and the pools' layout.
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
from run_meta import run_meta

from tandem.decode.staging import ScatterStaging
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.pd.parts import Link
from tandem.pd.transfer.head_map import Staging, Write
from tandem.pd.transfer.nixl_agent import NixlTransfer
from tandem.pd.transfer.pages import staged_pages
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


def _cache(pool: TokenToKVPool) -> CacheManager:
    table = ReqToTokenPool(4, 64, "cpu")
    return CacheManager(table, pool, create_prefix_cache(False, table, pool.allocator, SHAPE["page_size"]))


def _receiver(conn, num_pages: int, device: str, heads: tuple[int, int] | None, scatter: tuple[int, int] | None,
              staged: bool, n: int) -> None:
    """The decode side: holds `heads` (None: all). With `scatter` (the heads the sender holds)
    it acks every notification over the pipe, after moving what it staged into the send's
    pages (decode/staging.py) when `staged`: the sender's time then includes it."""
    dst = _pool(num_pages, device, heads)
    t = NixlTransfer("bench-decode")
    plan, lists, staging, link = Staging(), [], None, Link(())
    if scatter is not None and staged:
        staging = ScatterStaging(_cache(dst))
        dst.allocator.alloc_pages(num_pages // 2)  # the rooms' half: staging takes pages of the other
        width = scatter[1] - scatter[0]
        plan = Staging(1, SHAPE["num_kv_heads"] // width, num_pages)
        lists = staging.reserve(plan, n)
        link = Link((Write(0, 0, scatter, True, scatter=0),))
    conn.send((t.register(dst.layout()), dst.layout().to_dict(), lists, plan.per_page))
    peer_meta, peer_layout = conn.recv()
    t.add_peer(peer_meta, KVLayout(**peer_layout))
    rooms: list[tuple[list[int], bool]] = []
    while True:  # the receiving side polls (that drives its progress), as a decode scheduler does
        if conn.poll(0):  # once per loop iteration: not a spinning core
            msg = conn.recv()
            if msg == "stop":
                break
            rooms.append(msg)  # the next send's pages, and whether it goes through staging
        received = t.poll().received
        for _ in received if scatter is not None else ():  # only the scatter mode acks
            room, was_staged = rooms.pop(0)
            if was_staged:
                staging.scatter(link, lists, room)
            conn.send("ack")
        time.sleep(0.0002)
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
    p.add_argument("--prefill-heads", default=None, metavar="LO:HI",
                   help="the sender holds only KV heads [LO, HI) of 4 and the receiver all of them, as a prefill "
                        "TP rank writing into a decode of a smaller TP size; the receiver acks each send")
    p.add_argument("--staged", action="store_true", help="with --decode-heads: gather each send's slice into "
                   "staging pages of the sender's pool first (prefill/staging.py); with --prefill-heads: send "
                   "into the receiver's staging pages, which it moves into place before its ack (decode/staging.py)")
    p.add_argument("--out", default=None, help="default docs/results/kv_transfer[_scattered][_heads][_cuda].json")
    args = p.parse_args()
    heads = tuple(int(x) for x in args.decode_heads.split(":")) if args.decode_heads else None
    scatter = tuple(int(x) for x in args.prefill_heads.split(":")) if args.prefill_heads else None
    if args.staged and (heads is None) == (scatter is None) or heads and scatter:
        p.error("--staged needs one of --decode-heads and --prefill-heads; they exclude each other")
    cuda = args.device == "cuda"
    n = args.tokens // SHAPE["page_size"]
    num_pages = 8 * n + 1
    src = _pool(num_pages, args.device, scatter)
    src.kv_buffer.normal_()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, num_pages, args.device, heads, scatter, args.staged, n))
    proc.start()
    t = NixlTransfer("bench-prefill", timeout=120)
    meta = t.register(src.layout())
    peer_meta, peer_layout, lists, per_page = here.recv()
    peer_layout = KVLayout(**peer_layout)
    peer = t.add_peer(peer_meta, peer_layout)
    here.send((meta, src.layout().to_dict()))
    rng = random.Random(0)
    layout = src.layout()
    staging = None
    if args.staged and heads is not None:
        staging = SliceStaging(_cache(src))
        src.allocator.alloc_pages(num_pages // 2)  # the sources' half; staging takes pages of the other
    moving = heads or scatter
    nbytes = n * layout.page_bytes * 2 * layout.num_layers * (moving[1] - moving[0]) // layout.num_kv_heads \
        if moving else n * layout.page_bytes * 2 * layout.num_layers
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device)
    b = torch.empty_like(a)
    a.normal_()

    def pages() -> tuple[list[int], list[int]]:
        # staged: the lower half holds the rooms (requests' pages), the upper half staging
        top = num_pages // 2 if args.staged else num_pages
        if args.scattered:
            return rng.sample(range(1, top), n), rng.sample(range(1, top), n)
        s, d = rng.randrange(1, top - n), rng.randrange(1, top - n)
        return list(range(s, s + n)), list(range(d, d + n))

    def nixl_round(staged: bool = args.staged, sends: int = args.sends) -> float:
        t0 = time.perf_counter()
        for i in range(sends):
            sp, dp = pages()
            source, dest, into = None, None, dp
            if staged and heads is not None:
                got = staging.stage(f"r{i}", sp, heads)
                assert got is not None, "no room for staging"
                source, sp = got
            if scatter is not None:
                here.send((dp, staged))  # the receiver acks once it has the send (moved into place)
                if staged:
                    dest, into = peer_layout.sliced(scatter), staged_pages(lists[0], 0, n, per_page)
            t.send(peer, f"r{i}", sp, into, b"r" if scatter else b"", heads=moving, source=source, dest=dest)
            while not (ev := t.poll()).sent:
                pass
            assert ev.sent[0].ok, ev.sent
            if staging is not None and staged:
                staging.release(f"r{i}")
            if scatter is not None:
                assert here.recv() == "ack"
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
              "meta": run_meta(torch.device(args.device), layout=layout.to_dict(), sends_per_round=args.sends),
              "tokens": args.tokens, "bytes_per_send": nbytes, "scattered": args.scattered, "decode_heads": heads,
              "prefill_heads": scatter, "staged": args.staged,
              "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0], "rounds": rows,
              "median_ratio": statistics.median(r["ratio"] for r in rows),
              "median_ratio_all_threads": statistics.median(r["ratio_all_threads"] for r in rows)}
    if args.staged:
        result["median_staged_over_slices"] = statistics.median(r["staged_over_slices"] for r in rows)
    tag = (f"{'_scattered' if args.scattered else ''}{'_heads' if heads else ''}{'_to_wider' if scatter else ''}"
           f"{'_staged' if args.staged else ''}{'_cuda' if cuda else ''}")
    out = Path(args.out) if args.out else ROOT / f"docs/results/kv_transfer{tag}.json"
    out.write_text(json.dumps(result, indent=1))
    base = "device copy" if cuda else "memcpy"
    print(f"NIXL / {base} bandwidth, median of {args.rounds} rounds: {result['median_ratio']:.2f} "
          f"(vs torch's {all_threads}-thread copy: {result['median_ratio_all_threads']:.2f}) -> {out}")
    if args.staged:
        print(f"staged / the same slices sent as they lie: {result['median_staged_over_slices']:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
