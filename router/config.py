"""RouterConfig: everything `tandem router` was asked for (argparse lives in cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.policies import POLICIES
from tandem.router.worker_urls import UrlAllow, parse_worker_url
from tandem.router.workers import PREFILL
from tandem.web.coalesced_http import DEFAULT_STALL_TIMEOUT
from tandem.worker_contract import ROUTER_ADMIN_PORT


@dataclass(frozen=True)
class RouterConfig:
    tokenizer: str | None = None  # the model directory (tokenizer.json, template); None: route on bytes
    model_name: str | None = None  # the id clients send; None: taken from the first worker
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[str, ...] = ()  # colocated
    prefill: tuple[tuple[str, int], ...] = ()  # (url, bootstrap port)
    decode: tuple[str, ...] = ()
    namespace: str = "default"
    selectors: tuple[tuple[str, str], ...] = ()  # (role, label selector): Kubernetes discovery
    policy: str = "cache_aware"
    prefill_policy: str = "least_tokens"
    decode_policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance: float = 1.3
    local_prefill_threshold: int = 32
    max_retries: int = 2
    max_inflight: int = 4096
    max_queue: int = 1024
    queue_timeout: float = 30.0
    rate_limit: float | None = None  # requests per second (token bucket)
    burst: int = 64
    health_interval: float = 2.0
    health_timeout: float = 2.0
    health_fail_threshold: int = 2
    breaker_threshold: int = 5
    breaker_cooldown: float = 10.0
    request_timeout: float = 600.0
    api_key: str | None = None  # what clients must send
    admin_key: str | None = None  # the admin routes on the main listener (never the API key)
    admin_port: int = ROUTER_ADMIN_PORT  # the admin listener on 127.0.0.1; 0: none
    worker_api_key: str | None = None  # what the router sends to workers (their --api-key)
    worker_url_allow: tuple[str, ...] = ()  # hosts and networks POST /workers may add (router/worker_urls.py)
    stream_send_timeout: float = DEFAULT_STALL_TIMEOUT  # a client reading nothing this long is cut off; 0: never
    max_requests_per_client: int = 0  # per peer IP, queued included; 0: no limit
    max_request_bytes: int = 8 * 2**20
    # Scale from zero (router/capacity.py): how long a request waits for a worker of a role
    # with none eligible (0: answer 503 at once), and how many requests may wait at once.
    capacity_wait: float = 60.0
    max_capacity_waiters: int = 1024
    # The kv_events policy's subscription (router/kv_event_feed.py): each worker's KV events at
    # tcp://<its host>:kv_events_port (pods), or at its HTTP port + kv_events_port_offset (workers
    # sharing a host); with kv_events_replay, replays one port above (the workers' --kv-events-config).
    kv_events_port: int | None = None
    kv_events_port_offset: int | None = None
    kv_events_replay: bool = False
    kv_events_topic: str = ""
    # The Endpoint Picker (router/epp/): Envoy's ext-proc on this port (0: off), the picked
    # endpoint followed by up to epp_fallbacks others (a gateway retries down the list).
    epp_port: int = 0
    epp_fallbacks: int = 0

    def __post_init__(self) -> None:
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            if name not in POLICIES:
                raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {name!r}")
        if "kv_events" in (self.policy, self.prefill_policy, self.decode_policy) and (
                (self.kv_events_port is None) == (self.kv_events_port_offset is None)):
            raise ValueError("policy kv_events reads the workers' KV events: give --kv-events-port or "
                             "--kv-events-port-offset (one of them)")
        if self.kv_events_port is not None and not 1 <= self.kv_events_port <= 65534:
            raise ValueError(f"--kv-events-port must be in 1..65534, got {self.kv_events_port}")
        if self.kv_events_port_offset is not None and not -65535 < self.kv_events_port_offset < 65535:
            raise ValueError("--kv-events-port-offset must be within -65534..65534")
        if not 0 <= self.epp_port <= 65535 or self.epp_port and self.epp_port in (self.port, self.admin_port):
            raise ValueError(f"--epp-port {self.epp_port}: a free port other than the HTTP and admin ports")
        if not 0 <= self.epp_fallbacks <= 8:
            raise ValueError("--epp-fallbacks must be in 0..8")
        if self.capacity_wait < 0 or self.max_capacity_waiters < 0:
            raise ValueError("capacity_wait and max_capacity_waiters must be >= 0")
        if self.stream_send_timeout < 0 or self.max_requests_per_client < 0:
            raise ValueError("stream_send_timeout and max_requests_per_client must be >= 0")
        if self.admin_key and self.admin_key == self.api_key:
            raise ValueError("--admin-key must differ from --api-key: the API key must not reach the admin routes")
        if self.admin_port and self.admin_port == self.port:
            raise ValueError(f"--admin-port {self.admin_port} is the HTTP port")
        key = self.worker_api_key
        if key is not None and not (key.isascii() and key.isprintable()):
            raise ValueError("--worker-api-key must be printable ASCII (it goes into an HTTP header)")
        for url in self.static_urls:
            parse_worker_url(url)  # ValueError: a worker URL is http://HOST:PORT
        UrlAllow.build(self.worker_url_allow, self.static_urls, self.host)  # ValueError: an entry is no host/network

    @property
    def static_urls(self) -> tuple[str, ...]:
        return (*self.workers, *(url for url, _ in self.prefill), *self.decode)

    @property
    def url_allow(self) -> UrlAllow:
        return UrlAllow.build(self.worker_url_allow, self.static_urls, self.host)

    @property
    def pd(self) -> bool:
        """Configured for PD: from the flags, not from which pods exist (prefill may be at zero)."""
        return bool(self.prefill) or PREFILL in dict(self.selectors)
