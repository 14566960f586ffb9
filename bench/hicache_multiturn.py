"""Multi-turn chat whose working set is several times the device KV pool, with the host tier
(`enable_hierarchical_cache`) and without it, side by side in one run.

    python bench/hicache_multiturn.py --model small --rounds 2

Each of --chats conversations shares a system prompt and takes --turns turns; a turn sends the
whole conversation so far plus a new user message, and the conversations' turn k is sent in
groups of --concurrency requests (12: all at once, queueing for the pool as a burst of users
would; 1: one user at a time, so TTFT is the prefill's own). By the last turn the
conversations hold several times the pool's tokens, so without a tier each turn's earlier
context has been evicted and is prefilled again; with one it comes back from host memory.

Per variant: the prompt tokens prefilled (prompt - cached), TTFT p50/p90, and wall time, in
alternating rounds (A B A B ...); ratios are tier / no tier, median over rounds.
Results go to docs/results/hicache_multiturn_c<concurrency>.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def conversation_run(eng, chats: int, turns: int, system: int, user: int, answer: int, concurrency: int) -> dict:
    """One pass of the workload on a cold cache: the figures of every request."""
    eng.flush_cache()
    sp = {"max_new_tokens": answer, "temperature": 0, "ignore_eos": True}
    history = [list(range(100, 100 + system)) for _ in range(chats)]
    prefilled, cached, ttfts = 0, 0, []
    t = time.perf_counter()
    for turn in range(turns):
        prompts = [h + [1000 + 97 * c + 13 * turn + j for j in range(user)] for c, h in enumerate(history)]
        outs = [o for g in range(0, chats, concurrency) for o in eng.generate(prompts[g : g + concurrency], sp)]
        for c, (p, o) in enumerate(zip(prompts, outs)):
            meta = o["meta"]
            prefilled += meta["prompt_tokens"] - meta["cached_tokens"]
            cached += meta["cached_tokens"]
            ttfts.append(meta["ttft"])
            history[c] = p + o["token_ids"]
    wall = time.perf_counter() - t
    ttfts.sort()
    return {"prefilled_tokens": prefilled, "cached_tokens": cached, "wall_s": round(wall, 3),
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4), "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 4),
            "working_set_tokens": sum(len(h) for h in history)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pool-tokens", type=int, default=1536)
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--hicache-ratio", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=12, help="a turn's requests sent together, in groups of")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, help="default: docs/results/hicache_multiturn_c<concurrency>.json")
    args = ap.parse_args()
    args.out = args.out or ROOT / "docs" / "results" / f"hicache_multiturn_c{args.concurrency}.json"

    import torch

    from tandem import Engine
    from tandem.engine.modelgen.resolve import resolve_model

    path = str(resolve_model(args.model))
    common = dict(dtype=args.dtype, max_total_tokens=args.pool_tokens, page_size=16, chunked_prefill_size=512)
    variants = {"no_tier": {}, "host_tier": {"enable_hierarchical_cache": True, "hicache_ratio": args.hicache_ratio}}
    engines = {name: Engine(path, **common, **kw) for name, kw in variants.items()}
    work = (args.chats, args.turns, args.system, args.user, args.answer, args.concurrency)
    for eng in engines.values():
        conversation_run(eng, *work)  # warm-up: kernels built, allocator touched
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            rounds[name].append(conversation_run(eng, *work))
            print(name, rounds[name][-1], flush=True)
    host = engines["host_tier"].status()[0].info["host_tier"]
    for eng in engines.values():
        eng.shutdown()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])

    def ratio(key: str) -> float:
        return round(statistics.median(a[key] / b[key] for a, b in zip(rounds["host_tier"], rounds["no_tier"])), 3)

    result = {
        "model": args.model, "dtype": args.dtype, "pool_tokens": args.pool_tokens, "workload": {
            "chats": args.chats, "turns": args.turns, "system": args.system, "user": args.user,
            "answer": args.answer, "concurrency": args.concurrency},
        "working_set_over_pool": round(rounds["no_tier"][0]["working_set_tokens"] / args.pool_tokens, 2),
        "variants": {name: {k: median(name, k) for k in rounds[name][0]} for name in rounds},
        "tier_over_no_tier": {k: ratio(k) for k in ("prefilled_tokens", "ttft_p50_s", "ttft_p90_s", "wall_s")},
        "host_tier": host, "rounds": rounds,
    }
    result["meta"] = run_meta(torch.device("cpu"))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("working_set_over_pool", "tier_over_no_tier")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
