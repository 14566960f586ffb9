"""RouterConfig: everything `tandem router` was asked for (argparse lives in cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.policies import POLICIES
from tandem.router.workers import PREFILL


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
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    # Scale from zero (router/capacity.py): how long a request waits for a worker of a role
    # with none eligible (0: answer 503 at once), and how many requests may wait at once.
    capacity_wait: float = 60.0
    max_capacity_waiters: int = 1024

    def __post_init__(self) -> None:
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            if name not in POLICIES:
                raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        if self.capacity_wait < 0 or self.max_capacity_waiters < 0:
            raise ValueError("capacity_wait and max_capacity_waiters must be >= 0")

    @property
    def pd(self) -> bool:
        """Configured for PD: from the flags, not from which pods exist (prefill may be at zero)."""
        return bool(self.prefill) or PREFILL in dict(self.selectors)
