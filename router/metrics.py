"""The router's Prometheus series (conventional names, `tandem_router_` prefix)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.metric_names import (
    ITL_BUCKETS_SECONDS,
    ROUTER_CAPACITY_TIMEOUTS_TOTAL,
    ROUTER_CAPACITY_WAITS_TOTAL,
    ROUTER_PENDING_REQUESTS,
    ROUTER_ROLES,
    TTFT_BUCKETS_SECONDS,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tandem_router_requests", "requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("tandem_router_request_latency_seconds", "request arrival to last byte",
                                 buckets=TTFT_BUCKETS_SECONDS, registry=r)
        self.ttft = Histogram("tandem_router_time_to_first_token_seconds", "arrival to the first streamed chunk",
                              buckets=TTFT_BUCKETS_SECONDS, registry=r)
        self.itl = Histogram("tandem_router_inter_token_latency_seconds", "gap between streamed chunks",
                             buckets=ITL_BUCKETS_SECONDS, registry=r)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens", "prompt tokens routed", registry=r)
        self.generation_tokens = Counter("tandem_router_generation_tokens",
                                         "output tokens relayed (the worker's usage, else one per stream event)",
                                         registry=r)
        self.retries = Counter("tandem_router_retries", "attempts retried on another worker", registry=r)
        self.queue = Gauge("tandem_router_queue_depth", "requests waiting for admission", registry=r)
        self.inflight = Gauge("tandem_router_inflight_requests", "requests admitted and not finished", registry=r)
        self.worker_requests = Gauge("tandem_router_worker_requests", "requests in flight per worker",
                                     ["worker", "role"], registry=r)
        self.worker_tokens = Gauge("tandem_router_worker_tokens", "outstanding tokens per worker",
                                   ["worker", "role"], registry=r)
        self.worker_healthy = Gauge("tandem_router_worker_healthy", "1 when the health checks pass",
                                    ["worker", "role"], registry=r)
        self.breaker_open = Gauge("tandem_router_breaker_open", "1 while the worker's breaker is open",
                                  ["worker", "role"], registry=r)
        self.pd_decisions = Counter("tandem_router_pd_decisions", "PD mode: disaggregated, or decode alone",
                                    ["decision"], registry=r)
        self.epp_decisions = Counter("tandem_router_epp_decisions",
                                     "Endpoint Picker answers: picked, or the status it answered instead",
                                     ["outcome"], registry=r)
        self.epp_seconds = Histogram("tandem_router_epp_decision_seconds",
                                     "Endpoint Picker: the request's last byte in to its route out",
                                     buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), registry=r)
        self.cache_hits = Counter("tandem_router_cache_aware_hits", "cache_aware picks by prefix match", registry=r)
        self.cache_misses = Counter("tandem_router_cache_aware_misses", "cache_aware picks by load", registry=r)
        self.matched_tokens = Counter("tandem_router_estimated_cached_tokens",
                                      "prompt tokens the prefix index expects cached on the chosen worker",
                                      registry=r)
        # Scale from zero (router/capacity.py): the operator reads these by name.
        self.pending = Gauge(ROUTER_PENDING_REQUESTS, "requests held waiting for a worker of the role",
                             ["role"], registry=r)
        self.capacity_waits = Counter(ROUTER_CAPACITY_WAITS_TOTAL, "requests that waited for a worker of the role",
                                      ["role"], registry=r)
        self.capacity_timeouts = Counter(ROUTER_CAPACITY_TIMEOUTS_TOTAL,
                                         "requests answered 503 after waiting for a worker of the role",
                                         ["role"], registry=r)
        for role in ROUTER_ROLES:  # every series exists at 0: a rate() over them needs a start
            for series in (self.pending, self.capacity_waits, self.capacity_timeouts):
                series.labels(role)

    def render(self, workers: list[Any], queue: int, inflight: int) -> bytes:
        self.queue.set(queue)
        self.inflight.set(inflight)
        for w in workers:
            labels = (w.url, w.role)
            self.worker_requests.labels(*labels).set(w.requests)
            self.worker_tokens.labels(*labels).set(w.tokens)
            self.worker_healthy.labels(*labels).set(1.0 if w.healthy else 0.0)
            self.breaker_open.labels(*labels).set(0.0 if w.breaker.state == "closed" else 1.0)
        return generate_latest(self.registry)
