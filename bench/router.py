"""`tandem router` against `sglang-router` (PyPI), in the same run on the same backends.

    python bench/router.py overhead --rounds 3     # fake workers (bench/fake_worker.py)
    python bench/router.py cache --rounds 2        # 4 real tiny workers
    python bench/router.py events --rounds 2       # cache_aware vs kv_events, 4 workers under eviction
    python bench/router.py epp --rounds 3          # the EPP behind a real Envoy vs the router, fake workers

overhead: two fake workers (TTFT 20 ms, 16 tokens 5 ms apart). Sequential /generate
    requests straight to a worker and through each router, interleaved (direct, one router,
    the other, in turn), give the added p50/p99 latency;
    `--concurrency` requests at once give the most requests per second each router carries
    (in alternating slices, A B B A).
cache: a multi-tenant workload (8 tenants, each a ~600-token system prompt, then a short
    question; 128 requests, 8 at a time) over 4 workers behind each router's cache_aware
    policy. Prefix-cache hit rate = cached prompt tokens / prompt tokens, from the workers'
    answers; load balance = max/min requests served per worker. The workers' caches are
    flushed before each router's turn.

events: our router's cache_aware (its estimate of each worker's cache) against kv_events (the
    workers' own KV events, router/kv_event_index.py), in front of the same 4 tiny workers
    publishing events, with pools small enough (--pool tokens) that the tenants' prompts do not
    all fit: an estimate then believes in prefixes the worker has evicted. 16 tenants, 192
    requests, 8 at a time; the same hit rate and load balance as `cache`.

epp: the Endpoint Picker's cost beside the router's, on the same two fake workers. Sequential
    /generate requests, interleaved: straight to a worker; through `tandem router`; through Envoy
    with no EPP (a static route to one worker); through Envoy asking our EPP (full duplex, GIE's
    mode). Router overhead = router - direct; EPP decision overhead = Envoy+EPP - plain Envoy
    (the ext-proc round trips and the pick; Envoy's own proxying is in both), with the answer
    shown to the EPP (GIE's configuration) and without it (request phases only).

Rounds alternate the routers; results go to docs/results/router_<experiment>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests/support"))
from worker_process import Worker, free_port, sglang_router  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SP = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def _wait(url: str, path: str = "/health", timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def _ours(model: str, urls: list[str], policy: str) -> tuple[Worker, str]:
    r = Worker(["router", "--model", model, "--policy", policy, "--workers", *urls, "--log-level", "warning"])
    r.wait_ready()
    return r, r.url


def _routers(model: str, urls: list[str], policy: str,
             sglang_args: tuple[str, ...] = ()) -> tuple[Worker, str, subprocess.Popen, str]:
    """Both routers in front of `urls`; ours is stopped again if sglang-router fails to start."""
    ours, ours_url = _ours(model, urls, policy)
    try:
        sgl, sgl_url = sglang_router("--worker-urls", *urls, "--policy", policy, *sglang_args)
    except BaseException:
        ours.stop()
        raise
    return ours, ours_url, sgl, sgl_url


async def _latencies(urls: dict[str, str], n: int) -> dict[str, list[float]]:
    """n sequential requests to each target, interleaved (one to each in turn): drift in the
    machine's speed over the run falls on every target alike instead of on whichever ran then."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=60) as c:
        for i in range(n):
            for name, url in urls.items():
                t0 = time.perf_counter()
                body = {"text": f"ping {i}", "sampling_params": SP}
                (await c.post(url + "/generate", json=body)).raise_for_status()
                out[name].append(time.perf_counter() - t0)
    return out


async def _rate(url: str, n: int, concurrency: int) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                (await c.post(url + "/generate", json={"text": f"load {i}", "sampling_params": SP})).raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


def _rates(urls: dict[str, str], n: int, concurrency: int, slices: int = 4) -> dict[str, float]:
    """Requests per second of each target over n requests, sent in `slices` alternating slices
    (A B B A ...): as with the latencies, drift over the run falls on both alike."""
    spent = dict.fromkeys(urls, 0.0)
    names = list(urls)
    for k in range(slices):
        for name in names if k % 2 == 0 else names[::-1]:
            spent[name] += (n // slices) / asyncio.run(_rate(urls[name], n // slices, concurrency))
    return {name: (n // slices) * slices / t for name, t in spent.items()}


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def _fake_workers(n: int) -> tuple[list[int], list[subprocess.Popen], list[str]]:
    ports = [free_port() for _ in range(n)]
    fakes = [subprocess.Popen([sys.executable, str(ROOT / "bench/fake_worker.py"), "--port", str(p)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    return ports, fakes, [f"http://127.0.0.1:{p}" for p in ports]


def overhead(args: argparse.Namespace) -> dict:
    ports, fakes, urls = _fake_workers(2)
    rows = []
    try:
        for u in urls:
            _wait(u)
        ours, ours_url, sgl, sgl_url = _routers(args.model, urls, "round_robin")
        try:
            for r in range(args.rounds):
                order = [("tandem", ours_url), ("sglang", sgl_url)][:: 1 if r % 2 == 0 else -1]
                row: dict = asyncio.run(_latencies({"direct": urls[0], **dict(order)}, args.requests))
                for name, rps in _rates(dict(order), args.load, args.concurrency).items():
                    row[f"{name}_rps"] = rps
                d50, d99 = _pct(row["direct"], 0.5), _pct(row["direct"], 0.99)
                summary = {"round": r}
                for name in ("tandem", "sglang"):
                    summary[f"{name}_added_p50_ms"] = 1e3 * (_pct(row[name], 0.5) - d50)
                    summary[f"{name}_added_p99_ms"] = 1e3 * (_pct(row[name], 0.99) - d99)
                    summary[f"{name}_rps"] = row[f"{name}_rps"]
                summary["rps_ratio"] = summary["tandem_rps"] / summary["sglang_rps"]
                rows.append(summary)
                print(json.dumps({k: round(v, 2) for k, v in summary.items()}), flush=True)
        finally:
            ours.stop()
            sgl.terminate()
            sgl.wait(20)
    finally:
        for f in fakes:
            f.terminate()
            f.wait(20)
    keys = [k for k in rows[0] if k != "round"]
    return {"rounds": rows, "median": {k: statistics.median(r[k] for r in rows) for k in keys},
            "requests": args.requests, "load": args.load, "concurrency": args.concurrency}


def epp(args: argparse.Namespace) -> dict:
    from envoy_gateway import envoy

    ports, fakes, urls = _fake_workers(2)
    epp_port = free_port()
    rows = []
    try:
        for u in urls:
            _wait(u)
        ours = Worker(["router", "--model", args.model, "--policy", "round_robin", "--workers", *urls,
                       "--log-level", "warning", "--epp-port", str(epp_port)]).wait_ready()
        try:
            with envoy(epp_port) as gateway, envoy(0, plain_to=ports[0]) as plain, \
                    envoy(epp_port, response=False) as lean:
                for r in range(args.rounds):
                    order = [("router", ours.url), ("envoy_epp", gateway), ("envoy_epp_request_only", lean)]
                    order = order[:: 1 if r % 2 == 0 else -1]
                    row = asyncio.run(_latencies({"direct": urls[0], "envoy": plain, **dict(order)}, args.requests))
                    p50 = {k: 1e3 * _pct(v, 0.5) for k, v in row.items()}
                    p99 = {k: 1e3 * _pct(v, 0.99) for k, v in row.items()}
                    summary = {"round": r, "router_added_p50_ms": p50["router"] - p50["direct"],
                               "router_added_p99_ms": p99["router"] - p99["direct"],
                               "envoy_added_p50_ms": p50["envoy"] - p50["direct"],
                               "epp_added_p50_ms": p50["envoy_epp"] - p50["envoy"],
                               "epp_added_p99_ms": p99["envoy_epp"] - p99["envoy"],
                               "epp_request_only_added_p50_ms": p50["envoy_epp_request_only"] - p50["envoy"]}
                    summary["epp_vs_router_p50"] = summary["epp_added_p50_ms"] / summary["router_added_p50_ms"]
                    rows.append(summary)
                    print(json.dumps({k: round(v, 3) for k, v in summary.items()}), flush=True)
        finally:
            ours.stop()
    finally:
        for f in fakes:
            f.terminate()
            f.wait(20)
    keys = [k for k in rows[0] if k != "round"]
    return {"rounds": rows, "median": {k: statistics.median(r[k] for r in rows) for k in keys},
            "requests": args.requests}


def _tenant_workload(seed: int, tenants: int = 8, requests: int = 128) -> list[str]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(2000)]
    systems = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(tenants)]
    return [f"{rng.choice(systems)} question {i}: {' '.join(rng.choice(words) for _ in range(12))}"
            for i in range(requests)]


def _served(w: Worker) -> float:
    for line in w.get("/metrics").text.splitlines():
        if line.startswith('tandem_requests_total{reason="length"}'):
            return float(line.split()[-1])
    return 0.0


async def _run_tenants(url: str, prompts: list[str]) -> tuple[int, int]:
    async with httpx.AsyncClient(timeout=300) as c:
        sem = asyncio.Semaphore(8)
        cached = total = 0

        async def one(p: str) -> None:
            nonlocal cached, total
            async with sem:
                r = await c.post(url + "/generate", json={"text": p, "sampling_params": SP})
                r.raise_for_status()
                m = r.json()["meta_info"]
                cached, total = cached + m["cached_tokens"], total + m["prompt_tokens"]

        await asyncio.gather(*(one(p) for p in prompts))
        return cached, total


def _tenant_turn(name: str, url: str, workers: list[Worker], prompts: list[str], settle: float = 0.0) -> dict:
    """One router's turn on cold workers: its hit rate and max/min requests served. `settle`:
    a pause after the flush (a kv_events router hears of it a moment later)."""
    for w in workers:
        w.post("/flush_cache")
    time.sleep(settle)
    before = [_served(w) for w in workers]
    cached, total = asyncio.run(_run_tenants(url, prompts))
    served = [_served(w) - b for w, b in zip(workers, before)]
    return {f"{name}_hit_rate": cached / total, f"{name}_max_min_load": max(served) / max(1.0, min(served)),
            f"{name}_served": served}


def cache(args: argparse.Namespace) -> dict:
    workers = [Worker.colocated(Path(args.model), "--max-total-tokens", "16384") for _ in range(4)]
    rows = []
    try:
        for w in workers:
            w.wait_ready(600)
        urls = [w.url for w in workers]
        ours, ours_url, sgl, sgl_url = _routers(args.model, urls, "cache_aware", tuple(args.sglang_args.split()))
        try:
            for r in range(args.rounds):
                prompts = _tenant_workload(r)
                row: dict = {"round": r}
                for name, url in [("tandem", ours_url), ("sglang", sgl_url)][:: 1 if r % 2 == 0 else -1]:
                    row |= _tenant_turn(name, url, workers, prompts)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            ours.stop()
            sgl.terminate()
            sgl.wait(20)
    finally:
        for w in workers:
            w.stop()
    keys = [k for k in rows[0] if k != "round" and not k.endswith("_served")]
    return {"rounds": rows, "median": {k: statistics.median(r[k] for r in rows) for k in keys},
            "sglang_args": args.sglang_args}


def events(args: argparse.Namespace) -> dict:
    offset = 3
    workers = [Worker.publishing_kv_events(Path(args.model), "--max-total-tokens", str(args.pool), "--page-size",
                                           "16", offset=offset) for _ in range(4)]
    routers: dict[str, Worker] = {}
    rows = []
    try:
        for w in workers:
            w.wait_ready(600)
        urls = [w.url for w in workers]
        routers["cache_aware"] = _ours(args.model, urls, "cache_aware")[0]
        routers["kv_events"] = Worker(["router", "--model", args.model, "--policy", "kv_events", "--workers", *urls,
                                       "--kv-events-port-offset", str(offset), "--kv-events-replay",
                                       "--log-level", "warning"]).wait_ready()
        for r in range(args.rounds):
            prompts = _tenant_workload(r, tenants=16, requests=192)
            row: dict = {"round": r}
            for name in list(routers)[:: 1 if r % 2 == 0 else -1]:
                row |= _tenant_turn(name, routers[name].url, workers, prompts, settle=0.5)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for w in [*routers.values(), *workers]:
            w.stop()
    keys = [k for k in rows[0] if k != "round" and not k.endswith("_served")]
    return {"rounds": rows, "median": {k: statistics.median(r[k] for r in rows) for k in keys}, "pool": args.pool}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=["overhead", "cache", "events", "epp"])
    ap.add_argument("--pool", type=int, default=2048, help="events: each worker's KV pool, in tokens")
    ap.add_argument("--model", default=None, help="model directory (its tokenizer; cache: the workers' model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--load", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--sglang-args", default="", help="cache: more sglang-router flags, e.g. its balance thresholds")
    ap.add_argument("--out", default=None, help="results file (default docs/results/router_<experiment>.json)")
    args = ap.parse_args()
    if args.model is None:
        from tandem.engine.modelgen.resolve import resolve_model

        args.model = str(resolve_model("tiny"))
    result = {"overhead": overhead, "cache": cache, "events": events, "epp": epp}[args.experiment](args)
    out = Path(args.out) if args.out else ROOT / "docs/results" / f"router_{args.experiment}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
