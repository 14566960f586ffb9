"""HTTP serving throughput and TTFT: `tandem serve` against the offline Engine (what HTTP
costs) or against vLLM's OpenAI server (`vllm serve`, in its own venv: bench/README.md),
driven by one client on the same workload in the same run.

    python bench/serve.py engine --model tiny --rounds 4
    python bench/serve.py vllm   --model tiny --rounds 4

The client sends every request of workloads.throughput_workload (64 requests, 32-256
prompt tokens as ids, 64-128 new tokens, greedy, ignore_eos) to /v1/completions with
stream=true, at once (concurrency = the request count, as the offline Engine sees them) or
at most `--concurrency C` at a time, and measures output tokens per second over the whole
batch, each request's TTFT (send to first streamed token) and ITL (inter-token latency:
first to last token over the tokens between, so it does not depend on how many tokens a
server packs into one SSE chunk). A and B alternate round by round, the idle one frozen;
each figure is the median of the per-round ratios. Results go to
docs/results/serve_<mode>_<model>[_c<C>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests/server"))
from throughput import VLLM_PYTHON  # noqa: E402
from worker_process import Worker, free_port  # noqa: E402
from workloads import Request, throughput_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


async def _one(client: httpx.AsyncClient, model: str, r: Request) -> tuple[float, int, float]:
    body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, last, tokens = time.perf_counter(), None, 0.0, 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter() - t0
                ttft = last if ttft is None else ttft
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    itl = (last - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else float("nan")
    return ttft if ttft is not None else float("nan"), tokens, itl


def run_http(url: str, model: str, requests: list[Request], concurrency: int | None = None) -> dict:
    async def main() -> tuple[list[tuple[float, int, float]], float]:
        limits = httpx.Limits(max_connections=len(requests))
        gate = asyncio.Semaphore(concurrency or len(requests))

        async def gated(client: httpx.AsyncClient, r: Request) -> tuple[float, int, float]:
            async with gate:
                return await _one(client, model, r)

        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            await _one(client, model, Request([11, 12, 13], 4))  # warm-up (connections, first-call costs)
            t0 = time.perf_counter()
            rows = await asyncio.gather(*(gated(client, r) for r in requests))
            return rows, time.perf_counter() - t0

    rows, seconds = asyncio.run(main())
    out = sum(t for _, t, _ in rows)
    assert out == sum(r.max_new_tokens for r in requests), (out, "ignore_eos must give max_new_tokens")
    ttfts = sorted(t for t, _, _ in rows)
    return {"seconds": seconds, "output_tokens": out, "output_tok_per_s": out / seconds,
            "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "itl_p50": statistics.median(i for _, _, i in rows)}


def run_engine(model_dir: str, requests: list[Request], dtype: str) -> dict:
    """The offline Engine in a child process (its own threads, torch not in this client)."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); from throughput import _timed_generate, _warm_up;"
            "from workloads import Request; from tandem import Engine;"
            "reqs = [Request(**r) for r in json.loads(sys.stdin.read())];"
            f"eng = Engine({model_dir!r}, dtype={dtype!r}); _warm_up(eng);"
            "print('RESULT', json.dumps(_timed_generate(eng, reqs))); eng.shutdown()")
    payload = json.dumps([{"prompt_token_ids": r.prompt_token_ids, "max_new_tokens": r.max_new_tokens}
                          for r in requests])
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, cwd=ROOT,
                          check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[6:])


class VllmOpenAIServer:
    def __init__(self, model_dir: str, dtype: str, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
               "VLLM_CPU_KVCACHE_SPACE": "4"}
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               str(Path(VLLM_PYTHON).parent.parent / "lib/libiomp5.so")) if Path(p).exists()]
        env.setdefault("LD_PRELOAD", ":".join(preload))
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            # The module, not the `vllm` script: vllm-cpu's script looks up a "vllm" distribution.
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
             "--served-model-name", name, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(self.port)],
            env=env, cwd=tempfile.gettempdir(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm serve exited; see {self.log.name}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("vllm serve not ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Frozen:
    """`with Frozen(proc):` stops a server's whole process group (SIGSTOP) while the other
    side runs, so an idle server's polling threads take no CPU from the measured one."""

    def __init__(self, proc: subprocess.Popen | None) -> None:
        self.pgid = os.getpgid(proc.pid) if proc is not None else None

    def __enter__(self) -> None:
        if self.pgid is not None:
            os.killpg(self.pgid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        if self.pgid is not None:
            os.killpg(self.pgid, signal.SIGCONT)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "vllm"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--tandem-arg", action="append", default=[], help="extra `tandem serve` flag (repeatable)")
    args = p.parse_args()
    from tandem.engine.modelgen.resolve import resolve_model

    model_dir = str(resolve_model(args.model))
    ours = Worker(["serve", "--model", model_dir, "--served-model-name", args.model, "--dtype", args.dtype,
                   *args.tandem_arg])
    peer = None
    rows = []
    try:
        ours.wait_ready()
        peer = VllmOpenAIServer(model_dir, args.dtype, args.model) if args.mode == "vllm" else None
        warm = throughput_workload(n=args.requests, seed=1000)  # every batch shape's first-call costs, unmeasured
        for server, other in ((ours, peer), (peer, ours)):
            if server is not None:
                with Frozen(other.proc if other is not None else None):
                    run_http(server.url, args.model, warm, args.concurrency)
        for i in range(args.rounds):
            # A fresh workload per round (same for A and B): no prefix-cache hits across rounds.
            requests = throughput_workload(n=args.requests, seed=i)
            with Frozen(peer.proc if peer else None):
                a = run_http(ours.url, args.model, requests, args.concurrency)
            with Frozen(ours.proc):
                b = (run_http(peer.url, args.model, requests, args.concurrency) if peer
                     else run_engine(model_dir, requests, args.dtype))
            row = {"round": i, "tandem_serve": a, args.mode: b,
                   "throughput_ratio": a["output_tok_per_s"] / b["output_tok_per_s"]}
            if peer:
                row["ttft_p50_ratio"] = a["ttft_p50"] / b["ttft_p50"]
                row["itl_p50_ratio"] = a["itl_p50"] / b["itl_p50"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if "ratio" in k} | {
                "tandem_tok_s": round(a["output_tok_per_s"]), "peer_tok_s": round(b["output_tok_per_s"])}),
                flush=True)
    finally:
        ours.stop()
        if peer:
            peer.stop()
    result = {"mode": args.mode, "model": args.model, "dtype": args.dtype, "requests": args.requests,
              "concurrency": args.concurrency,
              "tandem_args": args.tandem_arg,
              "loadavg_1m": os.getloadavg()[0], "rounds": rows,
              "median_throughput_ratio": statistics.median(r["throughput_ratio"] for r in rows)}
    if peer:
        result["median_ttft_p50_ratio"] = statistics.median(r["ttft_p50_ratio"] for r in rows)
        result["median_itl_p50_ratio"] = statistics.median(r["itl_p50_ratio"] for r in rows)
    suffix = f"_c{args.concurrency}" if args.concurrency else ""
    out = ROOT / f"docs/results/serve_{args.mode}_{args.model}{suffix}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"median tandem serve / {args.mode}: throughput {result['median_throughput_ratio']:.3f}"
          + (f", TTFT p50 {result['median_ttft_p50_ratio']:.3f}, ITL p50 {result['median_itl_p50_ratio']:.3f}"
             if peer else "") + f" -> {out}")


if __name__ == "__main__":
    main()
