"""`tandem bench`: a load generator for any OpenAI-compatible endpoint, ours or another.

    tandem bench --url http://127.0.0.1:8000 --workload sharegpt --rate 4 --num-requests 200
    tandem bench --url http://127.0.0.1:8000 --compare http://127.0.0.1:8001 --labels pd,colocated ...

With --compare both endpoints get the identical request list, alternating A then B (B then A
in the next round), and the report gives B/A for every headline figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

from tandem.loadgen.load import LoadSpec, drive
from tandem.loadgen.plots import plot
from tandem.loadgen.report import Slo, ratios, summarize, table
from tandem.loadgen.workloads import WORKLOADS, WorkloadSpec, build


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test any OpenAI-compatible endpoint (TTFT, ITL, throughput, goodput)")
    p.add_argument("--url", required=True, help="the endpoint's base URL (without /v1)")
    p.add_argument("--compare", default=None, metavar="URL", help="a second endpoint, run on the same requests")
    p.add_argument("--labels", default="A,B", help="names of the two sides in the report")
    p.add_argument("--model", default=None, help="model id (default: the first of the endpoint's /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument("--num-requests", type=int, default=100, help="sessions (multi_turn: conversations)")
    g.add_argument("--prompt-len", type=_range, default=(64, 512), metavar="LO:HI", help="words per user turn")
    g.add_argument("--output-len", type=_range, default=(32, 256), metavar="LO:HI", help="max_tokens")
    g.add_argument("--tenants", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=512, help="shared_prefix: words per system prompt")
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--context-len", type=int, default=1500, help="long_context: words per prompt")
    g.add_argument("--chat", action="store_true", help="single-turn workloads through /v1/chat/completions")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, default=None, help="sessions per second, Poisson arrivals")
    g.add_argument("--concurrency", type=int, default=None, help="sessions in flight (default 8 without --rate)")
    g.add_argument("--warmup", type=int, default=2, help="sessions run first and not reported")
    g.add_argument("--duration", type=float, default=None, help="stop new arrivals after this many seconds")
    g.add_argument("--rounds", type=int, default=1, help="with --compare: alternations of A and B")
    g.add_argument("--timeout", type=float, default=600.0)
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--out", type=Path, default=Path("bench-results"), help="bench.json and bench.png go here")
    g.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _model(url: str, headers: dict[str, str]) -> str:
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise SystemExit(f"tandem bench: no model id from {url}/v1/models ({exc}); pass --model") from None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _progress(total: int, label: str, off: bool):  # type: ignore[no-untyped-def]
    try:
        from tqdm import tqdm
    except ImportError:
        off = True
    if off or not sys.stderr.isatty():
        return None
    return tqdm(total=total, desc=label, unit="req", leave=False)


def _run(args: argparse.Namespace) -> int:
    spec = WorkloadSpec(kind=args.workload, num=args.num_requests + args.warmup, prompt=args.prompt_len,
                        output=args.output_len, tenants=args.tenants, prefix=args.prefix_len, turns=args.turns,
                        context=args.context_len, seed=args.seed)
    concurrency = args.concurrency or (None if args.rate else 8)
    load = LoadSpec(rate=args.rate, concurrency=concurrency, warmup=args.warmup, duration=args.duration,
                    timeout=args.timeout, seed=args.seed)
    slo = Slo(ttft=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
              tpot=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls = [args.url] + ([args.compare] if args.compare else [])
    labels = args.labels.split(",")[:len(urls)] if args.compare else [args.labels.split(",")[0]]
    sessions = build(spec)
    results: dict[str, list] = {label: [] for label in labels}
    walls = dict.fromkeys(labels, 0.0)
    for rnd in range(args.rounds if args.compare else 1):
        order = list(zip(labels, urls))
        for label, url in order if rnd % 2 == 0 else order[::-1]:
            model = args.model or _model(url, headers)
            bar = _progress(len(sessions) - args.warmup, f"{label} round {rnd + 1}", args.no_progress)
            got, wall = asyncio.run(drive(url, model, sessions, load, chat=args.chat, headers=headers,
                                          tick=bar.update if bar else lambda n: None))
            if bar:
                bar.close()
            results[label] += got
            walls[label] += wall
    summaries = [summarize(results[label], walls[label], slo) for label in labels]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": ["tandem", *sys.argv[1:]], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "workload": dataclasses.asdict(spec), "load": dataclasses.asdict(load),
        "endpoints": dict(zip(labels, urls)), "runs": dict(zip(labels, summaries)),
    }
    if args.compare:
        report["ratios_b_over_a"] = ratios(*summaries)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    plot(args.out / "bench.png", labels, [results[label] for label in labels], summaries,
         f"tandem bench: {args.workload}, " + (f"{args.rate}/s" if args.rate else f"concurrency {concurrency}"))
    print(table(labels, summaries))
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
