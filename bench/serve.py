"""HTTP serving throughput, TTFT and ITL: `tandem serve` against the offline Engine (what
HTTP costs) or against vLLM's OpenAI server (`vllm serve`, in its own venv: bench/README.md),
driven by one client on the same workload in the same run.

    python bench/serve.py engine --model tiny --rounds 4
    python bench/serve.py vllm   --model tiny --rounds 4
    python bench/serve.py vllm   --model DIR --name smollm2 --concurrency 1,8,32 --requests 8,32,64

The client sends the requests of workloads.throughput_workload (`--requests`, default 64;
32-256 prompt tokens as ids, 64-128 new tokens, greedy, ignore_eos) to /v1/completions with
stream=true, at once (concurrency = the request count, as the offline Engine sees them) or
at most C at a time for each C in `--concurrency C1,C2,...` (`--requests` may then name one
count per level). Per run it measures output tokens per second over the whole batch, each
request's TTFT (send to first streamed token) and ITL (inter-token latency). A request's
mean ITL is first to last token over the tokens between, so it does not depend on how many
tokens a server packs into one SSE chunk; its median ITL is the median gap between streamed
chunks divided by the request's mean tokens per chunk (exact when every chunk carries one
token; `tokens_per_chunk` records how far from that a run was). A and B alternate round by
round, the idle one frozen; each figure is the median of the per-round ratios. Results go to
docs/results/serve_<mode>_<name>[_c<C>].json (one level: the flat layout; several: `levels`).

`--client threads,httpx,aiperf` (default threads) runs each client on the same requests in every
round. TTFT is send (connect included) to the first SSE event whose choice has non-empty text.
Every run records the client's own CPU (process time, all threads, and its share of the cores;
a warning above CLIENT_CPU_WARN), the server's (its process group, /proc/<pid>/stat), SSE
events, tokens per chunk, and the spread of the sends and response headers (the arrival
pattern, which TTFT at high concurrency depends on). docs/benchmarks.md, "Which client to
trust", says why the stdlib threads client is the default.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests/support"))
from throughput import VLLM_PYTHON  # noqa: E402
from worker_process import Worker, free_port  # noqa: E402
from workloads import Request, throughput_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RATIOS = ("output_tok_per_s", "ttft_p50", "itl_mean", "itl_p50")  # per round: tandem serve / peer


@dataclass(frozen=True)
class Streamed:
    """One streamed request: TTFT, output tokens, the times (from send) of its text chunks."""

    ttft: float
    tokens: int
    chunk_times: list[float]
    events: int = 0  # SSE data events, [DONE] aside (text chunks, the usage chunk, ...)
    start: float = 0.0  # perf_counter at send (connect included)
    headers: float = float("nan")  # send to the response's headers: the request has reached the server

    def itl_mean(self) -> float:
        if len(self.chunk_times) < 2 or self.tokens < 2:
            return float("nan")
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)

    def itl_median(self) -> float:
        if len(self.chunk_times) < 2 or self.tokens < 2:
            return float("nan")
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        return statistics.median(gaps) * (len(gaps) / (self.tokens - 1))


CLIENTS = ("threads", "httpx", "aiperf")
AIPERF = os.environ.get("AIPERF", "/tmp/tools/bin/aiperf")  # its own venv: docs/benchmarks.md, guidellm and aiperf
# Above this share of the machine's cores, the client is a bottleneck of its own: a server that
# sends more SSE events (one per token, where another coalesces tokens under load) pays for
# the client's parsing in its TTFT and throughput. The threads client stays well below it.
CLIENT_CPU_WARN = 0.25
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _body(model: str, r: Request) -> dict:
    return {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


class _Reader:
    """One SSE stream's events. TTFT is the time from send (connect included) to the first
    event whose choice carries non-empty text; `events` counts every data event but [DONE]."""

    def __init__(self) -> None:
        self.t0, self.times, self.tokens, self.events = time.perf_counter(), [], 0, 0
        self.headers = float("nan")

    def answered(self) -> None:
        self.headers = time.perf_counter() - self.t0

    def line(self, raw: str | bytes) -> None:
        line = (raw.decode() if isinstance(raw, bytes) else raw).rstrip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        self.events += 1
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            self.times.append(time.perf_counter() - self.t0)
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]

    def done(self) -> Streamed:
        return Streamed(self.times[0] if self.times else float("nan"), self.tokens, self.times, self.events,
                        self.t0, self.headers)


async def _one(client: httpx.AsyncClient, model: str, r: Request) -> Streamed:
    reader = _Reader()
    async with client.stream("POST", "/v1/completions", json=_body(model, r)) as resp:
        resp.raise_for_status()
        reader.answered()
        async for line in resp.aiter_lines():
            reader.line(line)
    return reader.done()


def _one_threaded(url: str, model: str, r: Request) -> Streamed:
    """The stdlib client: its own connection, blocking reads on this thread."""
    parts = urlsplit(url)
    reader = _Reader()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=1200)
    try:
        conn.request("POST", "/v1/completions", json.dumps(_body(model, r)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read()[:500])
        reader.answered()
        while line := resp.readline():
            reader.line(line)
    finally:
        conn.close()
    return reader.done()


def _pgroup_cpu(pgid: int | None) -> dict[int, float]:
    """CPU seconds (user + system, all threads) of every live process in a process group."""
    if pgid is None:
        return {}
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        if int(f[2]) == pgid:  # f[0] is state, f[2] pgrp, f[11] utime, f[12] stime
            out[int(d)] = (int(f[11]) + int(f[12])) / CLK_TCK
    return out


def _summary(rows: list[Streamed], seconds: float) -> dict:
    out = sum(s.tokens for s in rows)
    ttfts = sorted(s.ttft for s in rows)
    gaps = sum(len(s.chunk_times) - 1 for s in rows if len(s.chunk_times) > 1)
    return {"seconds": seconds, "output_tokens": out, "output_tok_per_s": out / seconds,
            "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "ttft_mean": statistics.fmean(ttfts),
            "itl_mean": statistics.fmean(s.itl_mean() for s in rows),
            "itl_p50": statistics.median(s.itl_median() for s in rows),
            "tokens_per_chunk": sum(s.tokens - 1 for s in rows if len(s.chunk_times) > 1) / max(gaps, 1),
            "sse_events": sum(s.events for s in rows),
            # How the batch reached the server: the spread of the sends, and of their answers' headers
            # (what a server that starts on the first arrivals sees as a staggered batch).
            "send_spread_s": max(s.start for s in rows) - min(s.start for s in rows),
            "headers_p50": statistics.median(s.headers for s in rows),
            "headers_max": max(s.start + s.headers for s in rows) - min(s.start for s in rows),
            "loadavg_1m": os.getloadavg()[0]}


def run_http(url: str, model: str, requests: list[Request], concurrency: int | None = None,
             client: str = "threads", server_pgid: int | None = None) -> dict:
    """One timed batch through `client` (CLIENTS), after one unmeasured warm-up request. Beside
    the serving figures it records this client's own CPU (process time, every thread) and, given
    `server_pgid`, the server's (its whole process group, from /proc) over the timed batch."""
    width = concurrency or len(requests)

    async def main_httpx() -> tuple[list[Streamed], float, float]:
        limits = httpx.Limits(max_connections=len(requests))
        gate = asyncio.Semaphore(width)

        async def gated(client: httpx.AsyncClient, r: Request) -> Streamed:
            async with gate:
                return await _one(client, model, r)

        async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits) as client:
            await _one(client, model, Request([11, 12, 13], 4))  # warm-up (connections, first-call costs)
            server0.update(_pgroup_cpu(server_pgid))
            cpu0, t0 = time.process_time(), time.perf_counter()
            rows = await asyncio.gather(*(gated(client, r) for r in requests))
            return rows, time.perf_counter() - t0, time.process_time() - cpu0

    def main_threads() -> tuple[list[Streamed], float, float]:
        _one_threaded(url, model, Request([11, 12, 13], 4))  # warm-up
        server0.update(_pgroup_cpu(server_pgid))
        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="serve-client") as pool:
            go = threading.Barrier(width + 1)  # all `width` threads exist before the clock starts
            started = [pool.submit(go.wait) for _ in range(width)]
            go.wait()
            for f in started:
                f.result()
            cpu0, t0 = time.process_time(), time.perf_counter()
            rows = list(pool.map(lambda r: _one_threaded(url, model, r), requests))
            return rows, time.perf_counter() - t0, time.process_time() - cpu0

    assert client in CLIENTS, client
    if client == "aiperf":
        return run_aiperf(url, model, requests, width, server_pgid)
    server0: dict[int, float] = {}  # read after the warm-up request
    rows, seconds, client_cpu = asyncio.run(main_httpx()) if client == "httpx" else main_threads()
    server1 = _pgroup_cpu(server_pgid)
    result = _summary(rows, seconds)
    cores = os.cpu_count() or 1
    result |= {"client": client, "client_cpu_s": client_cpu, "client_cpu_share": client_cpu / seconds / cores,
               "client_cpu_us_per_event": 1e6 * client_cpu / max(result["sse_events"], 1)}
    if server_pgid is not None:
        server_cpu = sum(v - server0.get(pid, 0.0) for pid, v in server1.items())
        lead = server1.get(server_pgid, 0.0) - server0.get(server_pgid, 0.0)
        result |= {"server_cpu_s": server_cpu, "server_cpu_share": server_cpu / seconds / cores,
                   "server_lead_cpu_s": lead}  # the group leader: tandem's front, vLLM's API server
    assert result["output_tokens"] == sum(r.max_new_tokens for r in requests), "ignore_eos must give max_new_tokens"
    return result


def run_aiperf(url: str, model: str, requests: list[Request], concurrency: int, server_pgid: int | None) -> dict:
    """The cross-check: NVIDIA's aiperf (its own process tree, its own timing) against /v1/completions,
    on synthetic text of the workload's mean prompt and output lengths (its prompts are text, not
    our ids), as many requests at the same concurrency, after one warm-up request. The client's CPU
    is aiperf's whole process tree, start-up included, over its whole wall time."""
    import resource
    import shutil

    isl = round(statistics.fmean(len(r.prompt_token_ids) for r in requests))
    osl = round(statistics.fmean(r.max_new_tokens for r in requests))
    out = Path(tempfile.mkdtemp(prefix="serve-aiperf-"))
    model_dir = os.environ.get("AIPERF_TOKENIZER") or _model_dir
    argv = [AIPERF, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", model_dir, "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--request-count", str(len(requests)),
            "--concurrency", str(concurrency), "--warmup-request-count", "1", "--random-seed", str(len(requests)),
            "--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(out)]
    # aiperf reads a local tokenizer directory only online-mode; not from the repo root (operator/).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    server0, kids0, t0 = _pgroup_cpu(server_pgid), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(argv, cwd=out, env={**env, "HF_HUB_DISABLE_TELEMETRY": "1"}, capture_output=True,
                          text=True, timeout=1800)
    wall, kids1, server1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN), _pgroup_cpu(
        server_pgid)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    j = json.loads((out / "profile_export_aiperf.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    ms = 1e-3
    cores = os.cpu_count() or 1
    client_cpu = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    server_cpu = sum(v - server0.get(pid, 0.0) for pid, v in server1.items())
    return {"client": "aiperf", "seconds": j["benchmark_duration"]["avg"],
            "output_tok_per_s": j["output_token_throughput"]["avg"],
            "output_tokens": j["output_sequence_length"]["avg"] * j["request_count"]["avg"],
            "requests_ok": j["request_count"]["avg"], "isl": isl, "osl": osl,
            "ttft_p50": j["time_to_first_token"]["p50"] * ms, "ttft_p90": j["time_to_first_token"]["p90"] * ms,
            "ttft_mean": j["time_to_first_token"]["avg"] * ms,
            "itl_mean": j["inter_token_latency"]["avg"] * ms, "itl_p50": j["inter_token_latency"]["p50"] * ms,
            "client_cpu_s": client_cpu, "client_wall_s": wall, "client_cpu_share": client_cpu / wall / cores,
            "server_cpu_s": server_cpu, "server_cpu_share": server_cpu / wall / cores,
            "tokens_per_chunk": float("nan"), "loadavg_1m": os.getloadavg()[0]}


_model_dir = ""  # the tokenizer aiperf loads: the served model's directory (main sets it)


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
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm serve exited; see {self.log.name}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("vllm serve not ready")

    def version(self) -> str:
        return httpx.get(self.url + "/version", timeout=10).json().get("version", "")

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


def _levels(concurrency: str | None, requests: str) -> list[tuple[int | None, int]]:
    """(concurrency, request count) per level; no --concurrency is one level, all at once."""
    cs: list[int | None] = [int(c) for c in concurrency.split(",")] if concurrency else [None]
    ns = [int(n) for n in requests.split(",")]
    assert len(ns) in (1, len(cs)), "--requests: one count, or one per concurrency level"
    return list(zip(cs, ns * len(cs) if len(ns) == 1 else ns))


def run_level(args: argparse.Namespace, level: int, ours: Worker, peer: VllmOpenAIServer | None, model_dir: str,
              concurrency: int | None, n: int) -> dict:
    """Warm both sides at this concurrency (unmeasured), then `--rounds` rounds; in each, every
    client of `--client` runs A then B on the same requests (the idle server frozen unless
    --no-freeze)."""
    clients = args.client.split(",")
    freeze = (lambda proc: Frozen(proc)) if args.freeze else (lambda proc: Frozen(None))
    warm = throughput_workload(n=min(n, 2 * concurrency) if concurrency else n, seed=10_000 + level)
    idle = _idle_cpu([s for s in (ours, peer) if s is not None]) if level == 0 else None
    for server, other in ((ours, peer), (peer, ours)):
        if server is not None:
            with freeze(other.proc if other is not None else None):
                run_http(server.url, args.name, warm, concurrency, clients[0])
    rows = []
    for i in range(args.rounds):
        # A fresh workload per round and level (same for A and B): no prefix-cache hits across runs.
        requests = throughput_workload(n=n, seed=100 * level + i)
        for client in clients:
            with freeze(peer.proc if peer else None):
                a = run_http(ours.url, args.name, requests, concurrency, client, os.getpgid(ours.proc.pid))
            with freeze(ours.proc):
                b = (run_http(peer.url, args.name, requests, concurrency, client, os.getpgid(peer.proc.pid))
                     if peer else run_engine(model_dir, requests, args.dtype))
            row = {"round": i, "client": client, "tandem_serve": a, args.mode: b}
            row |= {f"{k}_ratio": a[k] / b[k] for k in (RATIOS if peer else RATIOS[:1])}
            row["throughput_ratio"] = row.pop("output_tok_per_s_ratio")
            rows.append(row)
            print(json.dumps({"concurrency": concurrency, "client": client,
                              **{k: round(v, 3) for k, v in row.items() if "ratio" in k},
                              "tandem_tok_s": round(a["output_tok_per_s"]), "peer_tok_s": round(b["output_tok_per_s"]),
                              **_cpu_line(a, b), "loadavg_1m": round(a["loadavg_1m"], 2)}), flush=True)
            for side, r in (("tandem serve", a), (args.mode, b)):
                if r.get("client_cpu_share", 0) > CLIENT_CPU_WARN:
                    print(f"WARNING: the {client} client used {r['client_cpu_share']:.0%} of the {os.cpu_count()} "
                          f"cores against {side} (> {CLIENT_CPU_WARN:.0%}): it competes with the server and its "
                          "figures are suspect", flush=True)
    by_client = {}
    for client in clients:
        mine = [r for r in rows if r["client"] == client]
        keys = [k for k in mine[0] if k.endswith("_ratio")]
        by_client[client] = {f"median_{k}": statistics.median(r[k] for r in mine) for k in keys}
    head = {"concurrency": concurrency, "requests": n, "freeze": args.freeze, "idle_cpu_share": idle, "rounds": rows,
            "loadavg_1m": os.getloadavg()[0]}
    if len(clients) == 1:  # the flat layout, as before
        return {**head, "client": clients[0], **by_client[clients[0]]}
    return {**head, "clients": clients, "by_client": by_client}


def _idle_cpu(servers: list, seconds: float = 5.0) -> dict[str, float]:
    """Each server's CPU share of the cores while both sit idle and running (not frozen): what an
    idle server would take from the measured one without the freeze."""
    pgids = {type(s).__name__: os.getpgid(s.proc.pid) for s in servers}
    before = {k: _pgroup_cpu(g) for k, g in pgids.items()}
    time.sleep(seconds)
    after = {k: _pgroup_cpu(g) for k, g in pgids.items()}
    cores = os.cpu_count() or 1
    out = {k: sum(v - before[k].get(pid, 0.0) for pid, v in after[k].items()) / seconds / cores for k in pgids}
    print(json.dumps({"idle_cpu_share": out}), flush=True)
    return out


def _cpu_line(a: dict, b: dict) -> dict:
    """The per-round CPU figures: client share of the cores, server share, tokens per SSE chunk."""
    out = {}
    for tag, r in (("tandem", a), ("peer", b)):
        if "client_cpu_share" in r:
            out[f"{tag}_client_cpu"] = round(r["client_cpu_share"], 3)
            out[f"{tag}_server_cpu"] = round(r.get("server_cpu_share", float("nan")), 3)
            out[f"{tag}_tok_per_chunk"] = round(r["tokens_per_chunk"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "vllm"])
    p.add_argument("--model", default="tiny", help="a preset, a named model, or an HF directory")
    p.add_argument("--name", default=None, help="served model name and result file tag (default: --model's basename)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", default="64", help="requests per round; one count, or one per concurrency level")
    p.add_argument("--concurrency", default=None, help="comma-separated in-flight limits, e.g. 1,8,32 (default: all)")
    p.add_argument("--tandem-arg", action="append", default=[], help="extra `tandem serve` flag (repeatable)")
    p.add_argument("--client", default="threads",
                   help="comma-separated HTTP clients, each run on the same requests every round: threads (stdlib, "
                        "a thread and a connection per request; the default), httpx (one asyncio loop), aiperf "
                        "(the cross-check, $AIPERF, on text of the workload's mean lengths)")
    p.add_argument("--no-freeze", dest="freeze", action="store_false",
                   help="leave the idle server running (default: SIGSTOP it while the other is measured)")
    args = p.parse_args()
    args.name = args.name or Path(args.model).name
    from tandem.engine.modelgen.resolve import resolve_model

    model_dir = str(resolve_model(args.model))
    global _model_dir
    _model_dir = model_dir
    levels = _levels(args.concurrency, args.requests)
    ours = Worker(["serve", "--model", model_dir, "--served-model-name", args.name, "--dtype", args.dtype,
                   *args.tandem_arg])
    peer = None
    results, version = [], ""
    try:
        ours.wait_ready()
        peer = VllmOpenAIServer(model_dir, args.dtype, args.name) if args.mode == "vllm" else None
        version = peer.version() if peer else ""
        for level, (concurrency, n) in enumerate(levels):
            results.append(run_level(args, level, ours, peer, model_dir, concurrency, n))
    finally:
        ours.stop()
        if peer:
            peer.stop()
    head = {"mode": args.mode, "model": args.name, "model_dir": model_dir, "dtype": args.dtype,
            "peer_version": version, "tandem_args": args.tandem_arg}
    if len(results) == 1:  # the layout of a single-level run, as before
        result = {**head, **results[0]}
        suffix = f"_c{results[0]['concurrency']}" if results[0]["concurrency"] else ""
    else:
        result, suffix = {**head, "levels": results}, ""
    out = ROOT / f"docs/results/serve_{args.mode}_{args.name}{suffix}.json"
    out.write_text(json.dumps(result, indent=1))
    for r in results:
        for client, medians in r.get("by_client", {r.get("client"): r}).items():
            shares = [x[s]["client_cpu_share"] for x in r["rounds"] if x["client"] == client
                      for s in ("tandem_serve", args.mode) if "client_cpu_share" in x[s]]
            cpu = f"; client CPU {max(shares):.0%} of the cores at most" if shares else ""
            print(f"concurrency {r['concurrency'] or 'all'}, {client} client: median tandem serve / {args.mode}: "
                  + ", ".join(f"{k.removeprefix('median_').removesuffix('_ratio')} {v:.3f}"
                              for k, v in medians.items() if k.startswith("median_")) + cpu)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
