"""Which prefill addresses a decode rank talks to: its configured peers and what they resolve to.

A request names its prefill (bootstrap_host:bootstrap_port), but a client must not choose
where decode connects, hands its KV buffer's address and agent metadata, and takes KV
from. So decode connects only to `--pd-prefill-peers`: there the operator names the
prefill pods' headless Service (one name, every pod's IP), while the router sends a pod IP.

    request host:port  --port is a configured peer's?--no--> REFUSED
                          |yes
                          +--host is that peer's host?--yes--> ALLOWED
                          +--host is an IP the peer's name resolves to?--yes--> ALLOWED
                          +--not known yet: resolving (at most every `min_interval` s)--> PENDING
                          +--otherwise--> REFUSED

A request's own host is never resolved (decode would query DNS for whatever a client
writes). Resolution runs on a daemon thread, one at a time, so the scheduler loop never
waits on DNS: a PENDING request asks again on a later loop (bounded by its bootstrap timeout).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.parallel.group import TPGroup

log = logging.getLogger(__name__)

class Verdict(StrEnum):
    ALLOWED = "allowed"
    REFUSED = "refused"
    PENDING = "pending"  # its name is being resolved: ask again on a later loop


@dataclass(frozen=True)
class PeerAddress:
    host: str  # an IP in its canonical form, or a lower-case name
    port: int

    @property
    def key(self) -> str:
        """host:port, with an IPv6 host in brackets: the peer's key and its ZMQ address."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return "tcp://" + self.key


def canonical_host(host: str) -> str | None:
    """An IP in canonical form, a lower-case DNS name, or None for anything else ("*", "a b")."""
    host = host.strip().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.lower().rstrip(".").split(".")
    if not host or len(host) > 253 or not all(
            0 < len(lb) <= 63 and lb.replace("-", "").replace("_", "").isalnum() and lb.isascii() for lb in labels):
        return None
    return ".".join(labels)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_peers(text: str | None) -> list[PeerAddress]:
    """`--pd-prefill-peers` ("host:port,[v6]:port,..."); a ValueError names a bad entry."""
    peers = []
    for entry in (e.strip() for e in (text or "").split(",")):
        if not entry:
            continue
        host, _, port = entry.rpartition(":")
        name = canonical_host(host)
        if name is None or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--pd-prefill-peers: {entry!r} is not host:port")
        peers.append(PeerAddress(name, int(port)))
    return peers


class Allowlist:
    def __init__(self, peers: list[PeerAddress], min_interval: float = 2.0,
                 resolve: Callable[..., list[Any]] = socket.getaddrinfo) -> None:
        self.peers, self.min_interval, self._resolve = peers, min_interval, resolve
        self.names = sorted({p.host for p in peers if not is_ip(p.host)})
        self.addrs: dict[str, frozenset[str]] = {}  # name -> its IPs, as last resolved
        self.resolved_at = -min_interval
        self._thread: threading.Thread | None = None
        self._result: dict[str, frozenset[str]] | None = None
        self._refresh()

    def check(self, host: str, port: int) -> tuple[Verdict, str]:
        """(ALLOWED, the peer's key) or (REFUSED | PENDING, "")."""
        name = canonical_host(host)
        same_port = [p for p in self.peers if p.port == port]
        if name is None or not same_port:
            return Verdict.REFUSED, ""
        addr = PeerAddress(name, port)
        if any(p.host == name for p in same_port):
            return Verdict.ALLOWED, addr.key
        if not is_ip(name):
            return Verdict.REFUSED, ""  # names match literally: a request's name is never resolved
        self._collect()
        if any(name in self.addrs.get(p.host, ()) for p in same_port):
            return Verdict.ALLOWED, addr.key
        if self._thread is not None:
            return Verdict.PENDING, ""
        if time.monotonic() - self.resolved_at >= self.min_interval and self._refresh():
            return Verdict.PENDING, ""  # a pod that just came up may not have been in the last answer
        return Verdict.REFUSED, ""

    def agreed(self, addresses: list[tuple[str, int]], tp: TPGroup) -> list[tuple[Verdict, str]]:
        """check() of each (host, port), rank 0's verdicts on every TP rank (a collective):
        DNS answers each rank at its own moment."""
        verdicts = [self.check(host, port) for host, port in addresses] if tp.leader else []
        if tp.size > 1:
            sent = json.loads(tp.broadcast_bytes(json.dumps(verdicts).encode() if tp.leader else None))
            verdicts = [(Verdict(v), str(k)) for v, k in sent]
        return verdicts

    def refusal(self, host: str, port: int) -> str:
        """Why a request naming host:port is refused (a 400: a client's error, not a PD fault)."""
        if not self.peers:
            return "this decode worker has no --pd-prefill-peers: it takes no bootstrap_host/bootstrap_port"
        return (f"bootstrap_host/bootstrap_port {host[:80]!r}:{port} is not a prefill peer of this decode worker "
                "(--pd-prefill-peers)")

    def _refresh(self) -> bool:
        """Start resolving every configured name (if there are any); True if started."""
        if not self.names or self._thread is not None:
            return False
        self.resolved_at = time.monotonic()
        self._thread = threading.Thread(target=self._resolve_all, name="tandem-pd-resolve", daemon=True)
        self._thread.start()
        return True

    def _resolve_all(self) -> None:
        found = {}
        for name in self.names:
            try:
                found[name] = frozenset(str(ipaddress.ip_address(info[4][0].split("%")[0]))
                                        for info in self._resolve(name, None, type=socket.SOCK_STREAM))
            except (OSError, UnicodeError, ValueError) as exc:  # keep what it resolved to before
                log.warning("prefill peer %s did not resolve: %s", name, exc)
        self._result = found

    def _collect(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self.addrs = {**self.addrs, **(self._result or {})}
            self._thread, self._result = None, None
            self.resolved_at = time.monotonic()
