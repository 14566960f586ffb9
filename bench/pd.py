"""Prefill/decode disaggregation against colocated serving, and its two features beyond
SGLang's PD, each as a ratio from one run:

    python bench/pd.py --model small --rounds 3

Workers (all `tandem serve`, started here; every one stays up for the whole run):
    prefill  P
    decode   D  (the product defaults: decode-side prefix reuse on, local prefill <= 32 tokens)
    decode   D0 (SGLang's behaviour: reuse off, every request disaggregated)
    colocated C

Workloads (greedy, ignore_eos, sent through a minimal PD router: the same body to P and
D with bootstrap fields; TTFT is send -> first streamed token from decode):
    long      1k-token prompts, 16 new tokens: TTFT of P+D vs C one request at a time, and
              throughput (output tok/s) of 8 at once
    chat      multi-turn: 4 conversations x 4 turns, each turn adds ~64 tokens to a ~512-token
              history: KV bytes sent by P and TTFT, P+D vs P+D0
    short     20-token prompts: TTFT, P+D (prefilled on decode) vs P+D0 (disaggregated)

Rounds alternate the two sides of each comparison; a figure is the median of per-round
ratios. Results go to docs/results/pd_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests/support"))
from worker_process import Worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 8000) for _ in range(n)]


async def _one(client: httpx.AsyncClient, p: Worker | None, d: Worker, ids: list[int], new: int) -> float:
    """One request; the TTFT seen by the client of `d` (with `p`: disaggregated)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            "stream": True}
    if p is not None:
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap,
                 "bootstrap_room": random.randrange(2**63)}
        prefill = asyncio.ensure_future(client.post(p.url + "/generate", json={**body, "stream": False}))
    t0, ttft = time.perf_counter(), None
    async with client.stream("POST", d.url + "/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
    if p is not None:
        (await prefill).raise_for_status()
    return ttft if ttft is not None else float("nan")


async def _run(p: Worker | None, d: Worker, prompts: list[list[int]], new: int, concurrency: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        ttfts: list[float] = []
        for i in range(0, len(prompts), concurrency):
            ttfts += await asyncio.gather(*(_one(client, p, d, ids, new) for ids in prompts[i : i + concurrency]))
        wall = time.perf_counter() - t0
    return {"ttft_p50": statistics.median(ttfts), "tok_s": len(prompts) * new / wall}


def _sent(p: Worker) -> int:
    return p.get("/debug/pool").json()["ranks"][0]["pd"]["kv_bytes_sent"]


def _chat_turns(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    convs = []
    for _ in range(4):
        history = _words(rng, 512)
        turns = []
        for _ in range(4):
            history = history + _words(rng, 64)
            turns.append(list(history))
        convs.append(turns)
    return convs


def bench(args: argparse.Namespace) -> dict:
    flags = ("--max-total-tokens", "32768", "--chunked-prefill-size", "512")
    pre = Worker.prefill(args.model, *flags)
    dec = Worker.decode(args.model, *flags, peers=[pre])
    dec0 = Worker.decode(args.model, *flags, "--pd-local-prefill-threshold", "0",
                         "--disable-pd-decode-prefix-reuse", peers=[pre])
    col = Worker.colocated(args.model, *flags)
    rounds: dict[str, list[float]] = {k: [] for k in
                                      ("long_ttft", "long_tok_s", "chat_bytes", "chat_ttft", "short_ttft")}
    raw: list[dict] = []
    try:
        for w in (pre, dec, dec0, col):
            w.wait_ready(600)
        for r in range(args.rounds):
            rng = random.Random(r)
            long = [_words(rng, 1024) for _ in range(8)]
            short = [_words(rng, 20) for _ in range(16)]
            res: dict = {}
            sides = [("pd", pre, dec), ("col", None, col)] if r % 2 == 0 else [("col", None, col), ("pd", pre, dec)]
            for name, p, d in sides:
                res[f"long_seq_{name}"] = asyncio.run(_run(p, d, [[r + 1, *x] for x in long[:4]], 16, 1))
                res[f"long_par_{name}"] = asyncio.run(_run(p, d, [[r + 2, *x] for x in long], 16, 8))
            for name, d in ((("reuse", dec), ("noreuse", dec0)) if r % 2 == 0 else (("noreuse", dec0), ("reuse", dec))):
                before = _sent(pre)
                ttfts = []
                for turn in range(4):  # every conversation's turn t, then turn t+1: history is cached
                    prompts = [[r + 3, *c[turn]] for c in _chat_turns(100 * r + (name == "reuse"))]
                    ttfts.append(asyncio.run(_run(pre, d, prompts, 8, 1))["ttft_p50"])
                res[f"chat_{name}"] = {"bytes": _sent(pre) - before, "ttft_p50": statistics.median(ttfts[1:])}
                res[f"short_{name}"] = asyncio.run(_run(pre, d, [[r + 4, *x] for x in short], 8, 1))
            raw.append(res)
            rounds["long_ttft"].append(res["long_seq_pd"]["ttft_p50"] / res["long_seq_col"]["ttft_p50"])
            rounds["long_tok_s"].append(res["long_par_pd"]["tok_s"] / res["long_par_col"]["tok_s"])
            rounds["chat_bytes"].append(res["chat_reuse"]["bytes"] / res["chat_noreuse"]["bytes"])
            rounds["chat_ttft"].append(res["chat_reuse"]["ttft_p50"] / res["chat_noreuse"]["ttft_p50"])
            rounds["short_ttft"].append(res["short_reuse"]["ttft_p50"] / res["short_noreuse"]["ttft_p50"])
            print(json.dumps({k: round(v[-1], 3) for k, v in rounds.items()}), flush=True)
    finally:
        for w in (col, dec0, dec, pre):
            w.stop()
    return {"model": args.model, "rounds": args.rounds,
            "ratios": {k: statistics.median(v) for k, v in rounds.items()}, "raw": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    result = bench(args)
    out = ROOT / "docs/results" / f"pd_{Path(args.model).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratios"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
