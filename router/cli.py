"""`tandem router`: the front door (torch-free).

Keys: --api-key ($TANDEM_API_KEY) is what clients send; --admin-key ($TANDEM_ADMIN_KEY) opens
the admin routes on the main port (never the API key); --worker-api-key ($TANDEM_WORKER_API_KEY)
is what the router sends to workers. The admin listener is 127.0.0.1:--admin-port.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tandem.router.config import RouterConfig
from tandem.router.discovery import role_selectors
from tandem.router.policies import POLICIES
from tandem.web.coalesced_http import DEFAULT_STALL_TIMEOUT
from tandem.worker_contract import (
    ENV_ADMIN_KEY,
    ENV_API_KEY,
    ENV_WORKER_API_KEY,
    EPP_PORT,
    ROUTER_ADMIN_PORT_OFFSET,
    router_admin_port,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the OpenAI-compatible router in front of the workers")
    p.add_argument("--tokenizer", "--model", dest="tokenizer", default=None,
                   help="model directory with tokenizer.json (and its chat template); without it the "
                        "router routes on the text's bytes and sends workers text")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the workers')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", nargs="*", default=[], help="colocated worker URLs")
    p.add_argument("--prefill", nargs="*", default=[], help="prefill workers: URL=BOOTSTRAP_PORT")
    p.add_argument("--decode", nargs="*", default=[], help="decode worker URLs")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    p.add_argument("--selector", default=None, help="Kubernetes: label selector of colocated worker pods")
    p.add_argument("--prefill-selector", default=None, help="Kubernetes: label selector of prefill pods")
    p.add_argument("--decode-selector", default=None, help="Kubernetes: label selector of decode pods")
    for flag in ("--policy", "--prefill-policy", "--decode-policy"):
        p.add_argument(flag, choices=tuple(POLICIES), default=None)
    p.add_argument("--kv-events-port", type=int, default=None,
                   help="policy kv_events: the port of each worker's KV events (its --kv-events-config endpoint)")
    p.add_argument("--kv-events-port-offset", type=int, default=None,
                   help="or: that port is the worker's HTTP port plus this (workers sharing a host)")
    p.add_argument("--kv-events-replay", action="store_true", help="workers replay missed batches one port above")
    p.add_argument("--kv-events-topic", default="", help="the workers' KV events topic")
    p.add_argument("--local-prefill-threshold", type=int, default=32)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--max-inflight", type=int, default=4096,
                   help="sequences (prompts x n) dispatched at once; then requests queue")
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--queue-timeout", type=float, default=30.0)
    p.add_argument("--rate-limit", type=float, default=None, help="requests per second (token bucket)")
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--capacity-wait", type=float, default=60.0,
                   help="seconds a request waits for a worker of a role that has none ready (scale from zero); "
                        "0: answer 503 at once")
    p.add_argument("--max-capacity-waiters", type=int, default=1024,
                   help="requests held waiting for capacity at once; past it, 503 at once")
    p.add_argument("--api-key", default=None, help=f"require this bearer key of clients (or set ${ENV_API_KEY})")
    p.add_argument("--admin-key", default=None,
                   help=f"the key for the admin routes on --port (or set ${ENV_ADMIN_KEY}); without it they are "
                        "served on the admin listener only")
    p.add_argument("--admin-port", type=int, default=None,
                   help="the admin listener (drain, POST/DELETE /workers) on 127.0.0.1 "
                        f"(default --port + {ROUTER_ADMIN_PORT_OFFSET}); 0: none")
    p.add_argument("--worker-api-key", default=None,
                   help=f"the workers' --api-key, sent to them as a bearer key (or set ${ENV_WORKER_API_KEY})")
    p.add_argument("--worker-url-allow", nargs="*", default=[],
                   help="hosts, addresses and networks (CIDR) whose URLs POST /workers may add; by default only "
                        "the command line's workers, the ones discovered, and loopback when --host is loopback")
    p.add_argument("--stream-send-timeout", type=float, default=DEFAULT_STALL_TIMEOUT,
                   help="seconds a client may read nothing of its answer before it is cut off (0: never)")
    p.add_argument("--max-requests-per-client", type=int, default=0,
                   help="requests at once per client IP, queued ones included; past it 429 (0: no limit)")
    p.add_argument("--epp-port", type=int, default=0,
                   help="serve a gateway's Endpoint Picker (Envoy ext-proc over gRPC, GIE's protocol) on this "
                        f"port beside the HTTP front (GIE's EPP uses {EPP_PORT}); 0: off")
    p.add_argument("--epp-fallbacks", type=int, default=0,
                   help="the EPP names the picked endpoint and up to this many others, comma-separated, for a "
                        "gateway that retries down the list (plain Envoy's ORIGINAL_DST takes one: keep 0)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_run)


def _prefill(spec: str) -> tuple[str, int]:
    url, sep, port = spec.rpartition("=")
    if not sep or not port.isdigit():
        raise SystemExit(f"--prefill {spec!r}: expected URL=BOOTSTRAP_PORT")
    return url, int(port)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    try:
        cfg = _config(args)
    except ValueError as exc:  # a bad worker URL, allowlist entry or key: said plainly, no traceback
        raise SystemExit(f"tandem router: {exc}") from None
    import uvicorn

    from tandem.router.app import build_app
    from tandem.web import admin_listener
    from tandem.web.coalesced_http import http_protocol

    app = build_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           timeout_graceful_shutdown=10, proxy_headers=False, access_log=False,
                                           http=http_protocol(stall_timeout=cfg.stream_send_timeout)))
    admin_listener.run(server, app, cfg.admin_port)
    return 0 if server.started else 1


def _config(args: argparse.Namespace) -> RouterConfig:
    kw = {k: getattr(args, k) for k in ("policy", "prefill_policy", "decode_policy") if getattr(args, k)}
    return RouterConfig(
        tokenizer=args.tokenizer, model_name=args.model_name, host=args.host, port=args.port,
        workers=tuple(args.workers), prefill=tuple(_prefill(s) for s in args.prefill), decode=tuple(args.decode),
        namespace=args.namespace,
        selectors=tuple(role_selectors(args.selector, args.prefill_selector, args.decode_selector).items()),
        local_prefill_threshold=args.local_prefill_threshold, max_retries=args.max_retries,
        max_inflight=args.max_inflight, max_queue=args.max_queue, queue_timeout=args.queue_timeout,
        rate_limit=args.rate_limit, capacity_wait=args.capacity_wait, max_capacity_waiters=args.max_capacity_waiters,
        health_interval=args.health_interval, api_key=_env(args.api_key, ENV_API_KEY),
        admin_key=_env(args.admin_key, ENV_ADMIN_KEY),
        admin_port=router_admin_port(args.port) if args.admin_port is None else args.admin_port,
        worker_api_key=_env(args.worker_api_key, ENV_WORKER_API_KEY), worker_url_allow=tuple(args.worker_url_allow),
        stream_send_timeout=args.stream_send_timeout, max_requests_per_client=args.max_requests_per_client,
        kv_events_port=args.kv_events_port, kv_events_port_offset=args.kv_events_port_offset,
        kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic,
        epp_port=args.epp_port, epp_fallbacks=args.epp_fallbacks, **kw)


def _env(flag: str | None, name: str) -> str | None:
    return flag or os.environ.get(name) or None
