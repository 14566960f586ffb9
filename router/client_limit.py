"""Per-client concurrency: at most `--max-requests-per-client` requests at once from one peer IP.

Admission (admission.py) bounds the whole router; without this one client could take every
slot and fill the queue by itself (many streams it never reads, say). A request counts from
its arrival (queued ones too) until its last byte; past the bound the client gets 429.

The key is the TCP peer's address, the only one a client cannot write itself. Behind a load
balancer or a mesh sidecar that does not keep client addresses, every request shares one
peer: leave the limit off (0, the default) there, or set it well above one client's share.
"""

from __future__ import annotations

from tandem.web.errors import ApiError


class ClientLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: off
        self.counts: dict[str, int] = {}

    def acquire(self, peer: str) -> None:
        """Count one more request from `peer`, or ApiError(429) past the limit."""
        if not self.limit:
            return
        n = self.counts.get(peer, 0)
        if n >= self.limit:
            raise ApiError(429, f"this client already has {n} requests in flight (the router's limit per "
                                "client); wait for one to finish")
        self.counts[peer] = n + 1

    def release(self, peer: str) -> None:
        if not self.limit:
            return
        n = self.counts.get(peer, 0) - 1
        if n > 0:
            self.counts[peer] = n
        else:
            self.counts.pop(peer, None)  # no entry per client ever seen: the map stays as big as the load
