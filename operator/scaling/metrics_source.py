"""Where the autoscaler's numbers come from: each worker's /metrics, or a Prometheus server.

Both readers return {role: RoleMetrics} for prefill and decode, and an empty
RoleMetrics for a role they could not read, which the policy treats as "hold".
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any

import httpx

from tandem import metric_names as m
from tandem.operator import names
from tandem.operator.scaling.bounded_fetch import FetchLimits, fetch_text
from tandem.operator.scaling.signals import PodMetrics, RoleMetrics, pod_metrics, role_metrics, router_pending


@dataclass(frozen=True)
class PodRef:
    name: str
    ip: str


def ready_pods(pods: list[dict[str, Any]]) -> list[PodRef]:
    """Pods worth scraping: Ready, with an IP, and not terminating (a draining pod skews the numbers)."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            out.append(PodRef(str(meta.get("name")), str(status["podIP"])))
    return out


class ScrapeReader:
    """Scrapes pods directly; keeps the previous scrape to turn histogram counters into rates."""

    def __init__(self, client: httpx.AsyncClient, port: int = names.HTTP_PORT, concurrency: int = 16,
                 limits: FetchLimits = FetchLimits()):
        self._client = client
        self._port = port
        self._limits = limits  # a pod runs the tenant's image: its /metrics is capped (bounded_fetch.py)
        self._limit = asyncio.Semaphore(concurrency)
        self._previous: dict[str, dict[str, PodMetrics]] = {}

    async def _fetch(self, pod: PodRef) -> str | None:
        async with self._limit:
            try:
                return await fetch_text(self._client, f"http://{pod.ip}:{self._port}{names.METRICS_PATH}",
                                        self._limits)
            except httpx.HTTPError:
                return None  # unreachable, too big or too slow: no data from this pod, the others count

    async def _scrape(self, pod: PodRef) -> PodMetrics | None:
        text = await self._fetch(pod)
        return None if text is None else pod_metrics(pod.name, text)

    def loads(self, role: str) -> dict[str, float]:
        """Pod -> waiting + running requests at the last scrape (for pod-deletion-cost)."""
        return {name: (p.queue or 0.0) + (p.running or 0.0) for name, p in self._previous.get(role, {}).items()}

    async def read_pending(self, routers: list[PodRef]) -> dict[str, float]:
        """Held requests per worker role, summed over the router pods."""
        total = {names.PREFILL: 0.0, names.DECODE: 0.0}
        for text in await asyncio.gather(*(self._fetch(pod) for pod in routers)):
            for role, value in router_pending(text or "").items():
                total[role] += value
        return total

    async def read(self, pods: dict[str, list[PodRef]]) -> dict[str, RoleMetrics]:
        out: dict[str, RoleMetrics] = {}
        # Every pod of every role at once (up to `concurrency`): slow pods cost one deadline, not one each.
        rounds = await asyncio.gather(*(asyncio.gather(*(self._scrape(p) for p in refs)) for refs in pods.values()))
        for role, scraped in zip(pods, rounds, strict=True):
            current = [p for p in scraped if p is not None]
            out[role] = role_metrics(current, self._previous.get(role, {}))
            self._previous[role] = {p.pod: p for p in current}
        return out


class PrometheusReader:
    """Reads the same signals with PromQL; assumes the usual `namespace` and `pod` target labels."""

    def __init__(self, client: httpx.AsyncClient, url: str, window: str = "2m", limits: FetchLimits = FetchLimits()):
        self._client = client
        self._url = url.rstrip("/")  # from the CR: whatever answers there is untrusted (bounded_fetch.py)
        self._window = window
        self._limits = limits

    async def _query(self, promql: str) -> float | None:
        try:
            text = await fetch_text(self._client, f"{self._url}/api/v1/query", self._limits, {"query": promql})
            result = json.loads(text)["data"]["result"]
            if not result:
                return None
            value = float(result[0]["value"][1])
        # Any malformed answer is no data; RecursionError: JSON nested thousands of levels deep.
        except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError, RecursionError):
            return None
        return None if value != value else value  # NaN: no samples in the window

    async def read_role(self, namespace: str, instance: str, role: str) -> RoleMetrics:
        match = f'namespace="{namespace}",pod=~"{names.role_name(instance, role)}(-[a-z0-9]+){{2,3}}"'
        hist = m.TIME_TO_FIRST_TOKEN_SECONDS if role == names.PREFILL else m.INTER_TOKEN_LATENCY_SECONDS
        p95 = f"histogram_quantile(0.95, sum by (le) (rate({hist}_bucket{{{match}}}[{self._window}])))"
        pods, queue, kv, latency, handshake = await asyncio.gather(
            self._query(f"count({m.NUM_QUEUE_REQS}{{{match}}})"),
            self._query(f"avg({m.NUM_QUEUE_REQS}{{{match}}} + {m.NUM_RUNNING_REQS}{{{match}}})"),
            self._query(f"avg({m.KV_CACHE_USAGE}{{{match}}})"),
            self._query(p95),
            self._query(f"max({m.KV_HANDSHAKE_OK}{{{match}}})"),
        )
        return RoleMetrics(
            pods=int(pods or 0),
            queue_per_replica=queue,
            kv_utilization=kv,
            ttft_p95_s=latency if role == names.PREFILL else None,
            itl_p95_s=latency if role == names.DECODE else None,
            handshake_ok=None if handshake is None or role != names.DECODE else handshake >= 1,
        )

    async def read_pending(self, namespace: str, instance: str) -> dict[str, float]:
        match = f'namespace="{namespace}",pod=~"{names.role_name(instance, names.ROUTER)}-[a-z0-9]+-[a-z0-9]+"'
        selectors = {role: "decode|colocated" if role == names.DECODE else role for role in names.WORKER_ROLES}
        values = await asyncio.gather(*(self._query(f'sum({m.ROUTER_PENDING_REQUESTS}{{{match},role=~"{roles}"}})')
                                        for roles in selectors.values()))
        return {role: value or 0.0 for role, value in zip(selectors, values, strict=True)}

    async def read(self, namespace: str, instance: str) -> dict[str, RoleMetrics]:
        # Every query at once: a slow server costs one fetch deadline per round, not one per query.
        roles = names.WORKER_ROLES
        *results, pending = await asyncio.gather(*(self.read_role(namespace, instance, r) for r in roles),
                                                 self.read_pending(namespace, instance))
        return {r: replace(res, pending=pending[r]) for r, res in zip(roles, results, strict=True)}
