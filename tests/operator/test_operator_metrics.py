"""Reading worker metrics: the Prometheus text parser, histogram p95s, scraping, PromQL, and one autoscaler
round (plan) from metrics to status."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest

from tandem import metric_names as m
from tandem.operator.scaling import prometheus_text
from tandem.operator.scaling.autoscale_round import ServiceMemory, plan, read_metrics
from tandem.operator.scaling.metrics_source import PodRef, PrometheusReader, ScrapeReader, ready_pods
from tandem.operator.scaling.signals import RoleMetrics, pod_metrics, role_metrics, signal_value
from tandem.operator.spec.service_spec import parse_service


def exposition(queue: float, running: float, kv: float, handshake: float | None,
               ttft_counts: tuple[int, ...] = (0, 0, 0, 0),
               itl_counts: tuple[int, ...] = (0, 0, 0, 0)) -> str:
    lines = [
        f"# HELP {m.NUM_QUEUE_REQS} waiting requests", f"# TYPE {m.NUM_QUEUE_REQS} gauge",
        f'{m.NUM_QUEUE_REQS}{{model="x"}} {queue}',
        f"{m.NUM_RUNNING_REQS} {running}",
        f"{m.KV_CACHE_USAGE} {kv}",
    ]
    if handshake is not None:
        lines.append(f"{m.KV_HANDSHAKE_OK} {handshake}")
    histograms = ((m.TIME_TO_FIRST_TOKEN_SECONDS, ("0.5", "1.0", "2.0", "+Inf"), ttft_counts),
                  (m.INTER_TOKEN_LATENCY_SECONDS, ("0.02", "0.05", "0.1", "+Inf"), itl_counts))
    for name, bounds, counts in histograms:
        lines += [f'{name}_bucket{{le="{le}"}} {c}' for le, c in zip(bounds, counts, strict=True)]
        lines += [f"{name}_count {counts[-1]}", f"{name}_sum 1.0"]
    return "\n".join(lines) + "\n"


def test_parser_reads_labels_and_skips_garbage() -> None:
    samples = prometheus_text.parse('a{x="1",y="q\\"z"} 2.5\n# comment\nnot a sample line at all\nb 3 1700000000\n')
    assert [(s.name, s.value) for s in samples] == [("a", 2.5), ("b", 3.0)]
    assert samples[0].label("y") == 'q\\"z'


def test_histogram_quantile_interpolates_like_promql() -> None:
    hist = {0.5: 50.0, 1.0: 90.0, 2.0: 100.0, float("inf"): 100.0}
    assert prometheus_text.quantile(0.5, hist) == pytest.approx(0.5)
    assert prometheus_text.quantile(0.95, hist) == pytest.approx(1.5)
    assert prometheus_text.quantile(0.95, {1.0: 0.0, float("inf"): 0.0}) is None
    assert prometheus_text.quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0  # above the last finite bucket


def test_delta_handles_counter_resets() -> None:
    before = {1.0: 10.0, float("inf"): 12.0}
    assert prometheus_text.delta({1.0: 15.0, float("inf"): 20.0}, before) == {1.0: 5.0, float("inf"): 8.0}
    assert prometheus_text.delta({1.0: 2.0, float("inf"): 2.0}, before) == {1.0: 2.0, float("inf"): 2.0}


def test_role_metrics_aggregate_pods_and_use_histogram_deltas() -> None:
    first = [pod_metrics("p-1", exposition(2, 1, 0.5, 1, ttft_counts=(10, 10, 10, 10))),
             pod_metrics("p-2", exposition(4, 1, 0.7, 0))]
    role = role_metrics(first, {})
    assert role.pods == 2 and role.queue_per_replica == pytest.approx(4.0)  # (3 + 5) / 2: waiting + running
    assert role.kv_utilization == pytest.approx(0.6)
    assert role.handshake_ok is True
    # Only what happened since the previous read counts: 10 slow requests arrive on p-1.
    second = [pod_metrics("p-1", exposition(2, 1, 0.5, 1, ttft_counts=(10, 10, 20, 20)))]
    later = role_metrics(second, {p.pod: p for p in first})
    assert later.ttft_p95_s == pytest.approx(1.95)
    assert signal_value("ttftP95", later) == pytest.approx(1.95)


def test_idle_role_reads_zero_latency_so_it_can_scale_down() -> None:
    idle = RoleMetrics(pods=2, queue_per_replica=0.0)
    assert signal_value("ttftP95", idle) == 0.0
    assert signal_value("ttftP95", RoleMetrics()) is None


def test_ready_pods_skips_unready_terminating_and_ipless_pods() -> None:
    def pod(name: str, ready: bool, ip: str | None, deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if deleting:
            meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
        status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": meta, "status": status}

    pods = [pod("a", True, "10.0.0.1"), pod("b", False, "10.0.0.2"), pod("c", True, None),
            pod("d", True, "10.0.0.4", deleting=True)]
    assert ready_pods(pods) == [PodRef("a", "10.0.0.1")]


def test_scrape_reader_reads_each_pod_and_tolerates_failures() -> None:
    texts = {"10.0.0.1": exposition(1, 2, 0.4, None), "10.0.0.2": exposition(3, 2, 0.8, None)}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.port == 8000 and request.url.path == "/metrics"
        text = texts.get(request.url.host)
        return httpx.Response(200, text=text) if text else httpx.Response(503)

    async def go() -> dict[str, RoleMetrics]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            reader = ScrapeReader(client)
            return await reader.read({"prefill": [PodRef("a", "10.0.0.1"), PodRef("b", "10.0.0.2"),
                                                  PodRef("dead", "10.0.0.9")]})

    role = asyncio.run(go())["prefill"]
    assert role.pods == 2 and role.queue_per_replica == pytest.approx(4.0)
    assert role.kv_utilization == pytest.approx(0.6)


def test_prometheus_reader_queries_per_role() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        query = request.url.params["query"]
        seen.append(query)
        value = "2" if query.startswith("count(") else "0.42"
        return httpx.Response(200, json={"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]}})

    async def go() -> dict[str, RoleMetrics]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await PrometheusReader(client, "http://prom:9090/").read("serving", "chat")

    result = asyncio.run(go())
    assert result["prefill"].pods == 2 and result["prefill"].ttft_p95_s == pytest.approx(0.42)
    assert result["decode"].itl_p95_s == pytest.approx(0.42) and result["decode"].handshake_ok is False
    assert any(f"histogram_quantile(0.95, sum by (le) (rate({m.TIME_TO_FIRST_TOKEN_SECONDS}_bucket" in q
               for q in seen)
    assert all('namespace="serving"' in q for q in seen)
    assert any('pod=~"chat-decode(-[a-z0-9]+){2,3}"' in q for q in seen)  # generation-named pods too
    assert any(m.ROUTER_PENDING_REQUESTS in q and 'pod=~"chat-router-' in q for q in seen)
    assert result["decode"].pending == pytest.approx(0.42)


class FakePods:
    """Stands in for KubeApi.list in read_metrics."""

    def __init__(self, pods: dict[str, list[dict[str, Any]]]):
        self.pods = pods

    async def list(self, api_version: str, kind: str, namespace: str, labels: dict[str, str]) -> list[Any]:
        return self.pods[labels["app.kubernetes.io/component"]]


def test_read_metrics_scrapes_ready_pods_of_both_roles(autoscaling_cr: dict[str, Any]) -> None:
    def ready(ip: str) -> dict[str, Any]:
        return {"metadata": {"name": ip}, "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                                                    "status": "True"}]}}

    api = FakePods({"prefill": [ready("10.0.0.1")], "decode": [ready("10.0.1.1")],
                    "router": [ready("10.0.2.1"), ready("10.0.2.2")]})
    held = (f'{m.ROUTER_PENDING_REQUESTS}{{role="prefill"}} 2\n{m.ROUTER_PENDING_REQUESTS}{{role="decode"}} 1\n'
            f'{m.ROUTER_PENDING_REQUESTS}{{role="colocated"}} 0\n')
    texts = {"10.0.0.1": exposition(9, 3, 0.3, None), "10.0.1.1": exposition(0, 40, 0.9, 1),
             "10.0.2.1": held, "10.0.2.2": held}

    async def go() -> dict[str, RoleMetrics]:
        transport = httpx.MockTransport(lambda r: httpx.Response(200, text=texts[r.url.host]))
        async with httpx.AsyncClient(transport=transport) as client:
            return await read_metrics(api, client, parse_service(autoscaling_cr), ServiceMemory())  # type: ignore

    got = asyncio.run(go())
    assert got["prefill"].queue_per_replica == 12 and got["decode"].kv_utilization == 0.9
    assert got["decode"].handshake_ok is True
    assert (got["prefill"].pending, got["decode"].pending) == (4, 2)  # summed over both routers


def test_plan_reports_disabled_unavailable_and_active(minimal_cr: dict[str, Any],
                                                      autoscaling_cr: dict[str, Any]) -> None:
    off = plan(parse_service(minimal_cr), {}, {}, None, now=1000.0)
    assert (off.report.active, off.report.reason, off.status) == (False, "Disabled", {})

    svc = parse_service(autoscaling_cr)
    blind = plan(svc, {}, {}, None, now=1000.0)
    assert blind.report.reason == "MetricsUnavailable"
    assert blind.status["prefill"]["replicas"] == 2

    hot = {"prefill": RoleMetrics(pods=2, queue_per_replica=12.0, ttft_p95_s=3.0),
           "decode": RoleMetrics(pods=2, kv_utilization=0.7, itl_p95_s=0.03, handshake_ok=True)}
    state = None
    for i in range(3):  # 30 s of sustained load covers the scale-up window
        result = plan(svc, {}, hot, state, now=1000.0 + 15 * i)
        state = result.state
    assert result.report.active and result.status["prefill"]["replicas"] == 4
    assert result.status["prefill"]["lastScaleUpTime"].endswith("Z")
    assert "prefill 2->4" in result.status["lastDecision"]
    assert result.measured.ttft_p95_s == 3.0 and result.measured.handshake_ok is True


def test_plan_restarts_from_persisted_status(autoscaling_cr: dict[str, Any]) -> None:
    svc = parse_service(autoscaling_cr)
    status = {"autoscaler": {
        "prefill": {"replicas": 4, "specReplicas": 2, "lastScaleUpTime": "2030-01-01T00:00:00Z"},
        "decode": {"replicas": 3, "specReplicas": 2}}}
    calm = {"prefill": RoleMetrics(pods=4, queue_per_replica=0.0), "decode": RoleMetrics(pods=3,
                                                                                          kv_utilization=0.1)}
    result = plan(svc, copy.deepcopy(status), calm, None, now=1893456000.0 + 30)
    # Fresh memory after an operator restart: counts come from status, and nothing drops at once.
    assert (result.status["prefill"]["replicas"], result.status["decode"]["replicas"]) == (4, 3)
    assert result.status["prefill"]["lastScaleUpTime"] == "2030-01-01T00:00:00Z"
