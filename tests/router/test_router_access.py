"""Who may do what through the router: the admin API's worker URLs (strict, allowlisted;
router/worker_urls.py), the admin listener and admin key, the worker key sent to workers
instead of the client's, and the bounds on what one client holds (a stream it stops reading,
too many requests at once). The real router app in front of fake workers."""

from __future__ import annotations

import socket

import httpx
import pytest
from router_fakes import FakeWorker, fakes, router, run
from waits import async_wait_until

from tandem.router.config import RouterConfig
from tandem.router.upstream import UpstreamError, _target
from tandem.router.worker_urls import UrlAllow, parse_worker_url
from tandem.web.coalesced_http import http_protocol

ADMIN = {"Authorization": "Bearer adm"}
BAD_URLS = ["http://evil:80/x?", "http://10.0.0.1:8000/v1?a=b", "http://10.0.0.1:8000#f", "http://u:p@10.0.0.1:8000",
            "http://10.0.0.1:8000/path", "https://10.0.0.1:8000", "ftp://10.0.0.1:21", "http://10.0.0.1",
            "http://10.0.0.1:0", "http://10.0.0.1:99999", "http://:8000", "http://a b:8000", "http://x:8000\r\n",
            "http://10.0.0.1:8000\\@evil", "http://1.2.3:80", "10.0.0.1:8000"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_worker_urls_are_http_host_port_only(url: str) -> None:
    with pytest.raises(ValueError):
        parse_worker_url(url)


def test_good_worker_urls_and_the_allowlist() -> None:
    assert parse_worker_url("http://10.0.0.1:8000/") == "http://10.0.0.1:8000"
    assert parse_worker_url("http://[fd00::1]:8000") == "http://[fd00::1]:8000"
    assert parse_worker_url("http://decode-0.tandem.svc:8000") == "http://decode-0.tandem.svc:8000"
    allow = UrlAllow.build(["10.1.0.0/16", "worker.local"], ["http://10.9.9.9:8000"], "0.0.0.0")
    assert allow.allows("http://10.1.2.3:1234") and allow.allows("http://worker.local:80")
    assert allow.allows("http://10.9.9.9:8000") and not allow.allows("http://10.9.9.9:22")  # that URL, not its host
    assert allow.allows("http://10.7.7.7:8000", known=["http://10.7.7.7:8000"])  # discovered
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://10.2.0.1:8000", "http://169.254.169.254:80"):
        assert not allow.allows(url), url  # loopback only for a router that binds loopback
    assert UrlAllow.build([], [], "127.0.0.1").allows("http://127.0.0.1:5")
    with pytest.raises(ValueError):
        UrlAllow.build(["not a host/99"], [], "0.0.0.0")
    with pytest.raises(ValueError):
        RouterConfig(workers=("http://w:8000/x?y",))


def test_a_url_never_becomes_a_query_or_another_host() -> None:
    assert _target("http://w:8000/v1/completions", "application/json")[1].startswith(b"POST /v1/completions ")
    for url in ("http://evil:80/x?/v1/completions", "http://a@b:1/v1/completions", "http://w:1/x#/generate",
                "http://w:1/x\r\nX: y/generate"):
        with pytest.raises(UpstreamError):
            _target(url, "application/json")


def test_admin_api_needs_the_admin_listener_or_key_and_an_allowed_url() -> None:
    cfg = RouterConfig(model_name="tiny", api_key="cli", admin_key="adm", health_timeout=0.2,
                       worker_url_allow=("10.200.0.0/16",))

    async def test() -> None:
        async with router(cfg, admin=True) as (url, admin_url), httpx.AsyncClient() as c:
            body = {"url": "http://10.200.1.1:8000"}
            assert (await c.post(url + "/workers", json=body, headers={"Authorization": "Bearer cli"})).status_code \
                == 403  # the API key is not the admin key
            assert (await c.post(url + "/workers", json=body)).status_code == 403  # loopback is not enough
            assert (await c.post(url + "/workers", json=body, headers=ADMIN)).status_code == 200
            assert (await c.post(admin_url + "/workers", json={"url": "http://10.200.1.2:8000"})).status_code == 200
            for bad in ("http://10.200.1.1:8000/x?", "http://10.200.1.1:8000#", "http://u@10.200.1.1:8000"):
                r = await c.post(admin_url + "/workers", json={"url": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "url", bad
            r = await c.post(admin_url + "/workers", json={"url": "http://10.99.0.1:8000"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "worker_not_allowed"
            listed = (await c.get(admin_url + "/workers")).json()["workers"]
            assert {w["url"] for w in listed} == {"http://10.200.1.1:8000", "http://10.200.1.2:8000"}
            assert (await c.post(admin_url + "/v1/completions", json={})).status_code == 404  # admin only there

    run(test)


def test_workers_get_the_worker_key_never_the_clients() -> None:
    w = FakeWorker(key="wk")

    async def test() -> None:
        async with fakes(w) as urls, httpx.AsyncClient(headers={"Authorization": "Bearer ck"}) as c, \
                router(RouterConfig(model_name="tiny", workers=tuple(urls), api_key="ck", worker_api_key="wk",
                                    health_interval=0.1)) as (url, _):
            assert (await c.post(url + "/generate", json={"text": "x"})).status_code == 200
            r = await c.post(url + "/generate", json={"text": "x", "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert w.health_calls and all(h["authorization"] == "Bearer wk" for h in w.health_calls)
            assert [c.headers["authorization"] for c in w.posts] == ["Bearer wk", "Bearer wk"]

    run(test)


def _stalled_request(url: str) -> socket.socket:
    """A streaming request from a client that reads nothing (a small receive buffer fills at once)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = b'{"text": "x", "stream": true}'
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def _inflight(c: httpx.AsyncClient, url: str) -> float:
    text = (await c.get(url + "/metrics")).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("tandem_router_inflight_requests ")))


def test_a_client_that_stops_reading_loses_its_stream_and_slot() -> None:
    w = FakeWorker(chunks=None, chunk_bytes=65536)  # streams until the router hangs up

    async def test() -> None:
        async with fakes(w) as urls, httpx.AsyncClient() as c, \
                router(RouterConfig(model_name="tiny", workers=tuple(urls), stream_send_timeout=0.5),
                       http=http_protocol(stall_timeout=0.5)) as (url, _):
            sock = _stalled_request(url)
            try:
                async def released() -> bool:
                    return bool(w.streams_closed) and await _inflight(c, url) == 0

                await async_wait_until(released, 20, "the stalled stream to release the worker and its slot", 0.1)
            finally:
                sock.close()

    run(test)


def test_one_client_holds_at_most_max_requests_per_client() -> None:
    w = FakeWorker(chunks=20, gap=0.05)

    async def test() -> None:
        async with fakes(w) as urls, httpx.AsyncClient() as c, \
                router(RouterConfig(model_name="tiny", workers=tuple(urls), max_requests_per_client=1)) as (url, _):
            async with c.stream("POST", url + "/generate", json={"text": "x", "stream": True}) as first:
                assert first.status_code == 200
                second = await c.post(url + "/generate", json={"text": "x"})
                assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
                await first.aread()
            assert (await c.post(url + "/generate", json={"text": "x"})).status_code == 200  # its slot came back

    run(test)


def test_the_command_line_and_env_give_the_new_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.cli import build_parser
    from tandem.router.cli import _config

    monkeypatch.setenv("TANDEM_ADMIN_KEY", "adm")
    monkeypatch.setenv("TANDEM_WORKER_API_KEY", "wk")
    args = build_parser(("tandem.router.cli",)).parse_args([
        "router", "--workers", "http://127.0.0.1:9000", "--stream-send-timeout", "5", "--max-requests-per-client",
        "3", "--worker-url-allow", "10.0.0.0/8", "workers.svc"])
    cfg = _config(args)
    assert (cfg.admin_key, cfg.worker_api_key, cfg.admin_port) == ("adm", "wk", 8002)
    assert (cfg.stream_send_timeout, cfg.max_requests_per_client) == (5.0, 3)
    assert cfg.url_allow.allows("http://10.3.3.3:8000") and cfg.url_allow.allows("http://workers.svc:8000")
    args = build_parser(("tandem.router.cli",)).parse_args(["router", "--workers", "http://w:1/?x"])
    with pytest.raises(ValueError, match="query"):
        _config(args)
