"""Metric fetches against hostile servers on 127.0.0.1 (a tenant controls both prometheusUrl and the
image behind each pod's /metrics): an endless body, a huge declared one, a trickle one byte at a time,
a gzip answer, JSON nested too deep. Each fails that fetch within its cap and deadline; a sync pass
reports no metrics and carries on."""

from __future__ import annotations

import asyncio
import copy
import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from operator_fake_api import LOG, FakeApiServer

from tandem.operator import sync as sync_module
from tandem.operator.kubeapi import KubeApi
from tandem.operator.scaling.autoscale_round import ServiceMemory
from tandem.operator.scaling.bounded_fetch import MAX_BYTES, FetchError, FetchLimits, fetch_text
from tandem.operator.scaling.metrics_source import PodRef, PrometheusReader, ScrapeReader

GOOD = b"tandem_num_queue_reqs 3\ntandem_num_running_reqs 1\n"
CHUNK = b"x" * 65536


class Hostile(http.server.BaseHTTPRequestHandler):
    """The behaviour is the server's `mode`; the body is close-delimited (HTTP/1.0)."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        mode = self.server.mode  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        if mode == "declared":
            self.send_header("Content-Length", str(10 * 2**30))
        if mode == "gzip":
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        try:
            if mode in ("good", "gzip"):
                self.wfile.write(GOOD)
            elif mode == "deep":
                self.wfile.write(b"[" * 200_000)
            elif mode in ("endless", "declared"):
                while True:
                    self.wfile.write(CHUNK)
            elif mode == "trickle":
                while True:
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.1)  # sleep-ok: a trickling metrics server: one byte per 0.1 s
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(mode: str) -> int:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
        server.daemon_threads = True
        server.mode = mode  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def fetch(port: int, limits: FetchLimits = FetchLimits(), path: str = "/metrics") -> tuple[str | Exception, float]:
    """(text or the exception, seconds taken); the client's per-read timeout is the operator's 2 s."""
    async def go() -> str:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            return await fetch_text(client, f"http://127.0.0.1:{port}{path}", limits)

    started = time.monotonic()
    try:
        result: str | Exception = asyncio.run(go())
    except Exception as exc:  # noqa: BLE001 (returned for the test to inspect)
        result = exc
    return result, time.monotonic() - started


def test_a_normal_answer_comes_back(serve: Any) -> None:
    text, _ = fetch(serve("good"))
    assert text == GOOD.decode()


def test_an_endless_body_stops_at_the_cap(serve: Any) -> None:
    port = serve("endless")
    error, took = fetch(port)
    assert isinstance(error, FetchError) and f"{MAX_BYTES}-byte cap" in str(error) and took < 5
    small, _ = fetch(port, FetchLimits(max_bytes=100_000))
    assert isinstance(small, FetchError) and "100000-byte cap" in str(small)


def test_a_huge_declared_length_is_refused_before_reading(serve: Any) -> None:
    error, took = fetch(serve("declared"))
    assert isinstance(error, FetchError) and "over the" in str(error) and took < 2


def test_a_trickle_hits_the_overall_deadline(serve: Any) -> None:
    # A byte every 0.1 s never trips the 2 s per-read timeout; only the total deadline ends it.
    error, took = fetch(serve("trickle"), FetchLimits(deadline_s=1.0))
    assert isinstance(error, FetchError) and "within 1 s" in str(error)
    assert 0.9 < took < 2.0


def test_a_compressed_answer_is_refused(serve: Any) -> None:
    error, _ = fetch(serve("gzip"))
    assert isinstance(error, FetchError) and "Content-Encoding gzip" in str(error)


def test_scrape_reader_counts_a_hostile_pod_as_no_data(serve: Any) -> None:
    async def read(port: int) -> Any:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            reader = ScrapeReader(client, port=port, limits=FetchLimits(deadline_s=1.0))
            return await reader.read({"decode": [PodRef("p", "127.0.0.1")]})

    assert asyncio.run(read(serve("good")))["decode"].pods == 1
    for mode in ("endless", "trickle", "declared"):
        started = time.monotonic()
        assert asyncio.run(read(serve(mode)))["decode"].pods == 0, mode
        assert time.monotonic() - started < 2.0, mode


def test_prometheus_reader_survives_hostile_answers(serve: Any) -> None:
    async def read(port: int) -> Any:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            reader = PrometheusReader(client, f"http://127.0.0.1:{port}", limits=FetchLimits(deadline_s=1.0))
            return await reader.read("serving", "chat")

    for mode in ("endless", "trickle", "deep", "good"):  # "good" is not JSON: no data either
        started = time.monotonic()
        got = asyncio.run(read(serve(mode)))
        assert got["prefill"].pods == 0 and got["decode"].queue_per_replica is None, mode
        assert time.monotonic() - started < 2.5, mode  # the queries run at once: one deadline, not seven


@pytest.mark.parametrize("mode", ["endless", "trickle"])
def test_sync_reports_no_metrics_and_carries_on(autoscaling_cr: dict[str, Any], serve: Any, mode: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_module, "METRICS_ROUND_S", 1.0)  # the round's own deadline, shortened for the test
    cr = copy.deepcopy(autoscaling_cr)
    cr["spec"]["autoscaling"]["metricsSource"] = {"type": "prometheus",
                                                  "prometheusUrl": f"http://127.0.0.1:{serve(mode)}"}
    server = FakeApiServer()

    async def go() -> Any:
        api = httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(server))
        async with api, httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
            return await sync_module.sync(cr, KubeApi(api), http, ServiceMemory(), LOG, autoscale=True,
                                          prune_strays=False)

    started = time.monotonic()
    result = asyncio.run(go())
    assert time.monotonic() - started < 4.0
    assert result.error is None  # children applied; only the scaling decision holds
    scaling = next(c for c in result.status["conditions"] if c["type"] == "ScalingActive")
    assert scaling["status"] == "False" and scaling["reason"] == "MetricsUnavailable"
