"""Worker URLs: where the router may send requests (prompts, and --worker-api-key with them).

A worker URL is `http://HOST:PORT` and nothing more: no path, query, fragment or user info,
no `?`, `#`, `@`, backslash, space or control character anywhere. HOST is an IP literal
(IPv6 in brackets) or a DNS name. The router appends its own paths (/v1/completions, ...), so
a URL with a `?` in it would turn every request's path into a query on some other endpoint.

Registration over the admin API (POST /workers) must also pass the allowlist:

    a URL the command line gave (--workers, --prefill, --decode)  allowed
    a worker the router already knows (command line, discovery)   allowed (same host and port)
    a host or IP network in --worker-url-allow (any port)          allowed
    a loopback address, when the router itself binds loopback     allowed (`tandem up`, tests)
    anything else                                                  refused

So by default nothing new can be added from outside: a cluster that registers workers by
hand lists their network (`--worker-url-allow 10.0.0.0/8`) or names.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

_FORBIDDEN = re.compile(r"[?#@\\\s\x00-\x1f\x7f]")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")
_LOOPBACK_BINDS = {"127.0.0.1", "::1", "localhost"}

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_worker_url(url: str) -> str:
    """`url` without a trailing slash, or ValueError saying why it is not a worker URL."""
    if _FORBIDDEN.search(url):
        raise ValueError(f"{url!r}: a worker URL has no query, fragment, user info, spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: a worker URL is http:// (the router speaks plain HTTP to its workers)")
    if parts.path not in ("", "/"):
        raise ValueError(f"{url!r}: a worker URL is http://HOST:PORT, with no path")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r}: the port is not a number in 1..65535") from None
    host = parts.hostname or ""
    if port is None or port == 0 or not _valid_host(host):
        raise ValueError(f"{url!r}: a worker URL is http://HOST:PORT (an IP address or DNS name, and a port)")
    return f"http://{parts.netloc}"


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_DNS_NAME.match(host)) and not host.replace(".", "").isdigit()  # 1.2.3 is no name


def host_of(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class UrlAllow:
    networks: tuple[Network, ...] = ()
    hosts: frozenset[str] = frozenset()  # names and addresses from --worker-url-allow, any port
    urls: frozenset[str] = frozenset()  # the command line's worker URLs
    loopback: bool = False

    @classmethod
    def build(cls, entries: Iterable[str], static_urls: Iterable[str], bind_host: str) -> UrlAllow:
        """From --worker-url-allow (CIDRs, addresses, names), the configured URLs and --host.
        ValueError for an entry that is none of those."""
        networks, hosts = [], set()
        for entry in entries:
            if "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"--worker-url-allow {entry!r}: not an IP network") from None
            elif _valid_host(entry.strip("[]")):
                hosts.add(entry.strip("[]").lower())
            else:
                raise ValueError(f"--worker-url-allow {entry!r}: not a host, an address or a network")
        return cls(tuple(networks), frozenset(hosts), frozenset(u.rstrip("/") for u in static_urls),
                   bind_host in _LOOPBACK_BINDS)

    def allows(self, url: str, known: Iterable[str] = ()) -> bool:
        """Whether `url` (already parsed by parse_worker_url) may be registered; `known` are the
        URLs of the workers the router has now."""
        if url in self.urls or url in set(known):
            return True
        host = host_of(url)
        if host in self.hosts:
            return True
        ip = _ip(host)
        if ip is None:
            return self.loopback and host == "localhost"
        return (self.loopback and ip.is_loopback) or any(ip in n for n in self.networks if n.version == ip.version)
