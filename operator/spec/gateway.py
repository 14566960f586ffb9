"""spec.gateway: serving through a Gateway API Inference Extension (GIE) gateway.

The parsed section says what render/gateway.py builds (an InferencePool, optionally an HTTPRoute
from a Gateway to it, the Endpoint Picker's Service and the NetworkPolicy that lets the gateway's
proxy reach the decode pods) and which port the router's Endpoint Picker listens on.
The parser appends problems to `errors`, as every section parser does (sections.py); it
repeats the schema's bounds because a CR that skipped admission may hold anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem import worker_contract as contract
from tandem.operator.spec.field_checks import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    GATEWAY_DURATION,
    HOSTNAME,
    _choice,
    _int,
    _name,
)
from tandem.operator.spec.spec_schema import (
    FAILURE_MODES,
    MAX_HOSTNAMES,
    MAX_HTTP_FROM_NAMESPACES,
    ROUTE_REQUEST_TIMEOUT,
)

WHERE = "spec.gateway"


@dataclass(frozen=True)
class ParentRef:
    """The Gateway (gateway.networking.k8s.io) the HTTPRoute attaches to."""

    name: str
    namespace: str | None = None  # None: the InferenceService's namespace
    section_name: str | None = None  # None: every listener of the Gateway


@dataclass(frozen=True)
class HttpRouteSpec:
    parent: ParentRef
    hostnames: tuple[str, ...] = ()
    request_timeout: str = ROUTE_REQUEST_TIMEOUT  # a Gateway API duration; "0s": none


@dataclass(frozen=True)
class GatewaySpec:
    """Present only when an InferencePool is wanted (inferencePool.enabled)."""

    epp_port: int
    failure_mode: str  # one of FAILURE_MODES
    route: HttpRouteSpec | None = None
    http_from_namespaces: tuple[str, ...] = ()  # as listed in the spec

    @property
    def admitted_namespaces(self) -> tuple[str, ...]:
        """The namespaces whose pods may reach the decode pods' HTTP port: those listed, plus the
        Gateway's own when the route names one. Istio and kgateway run a Gateway's proxy pods in
        its namespace (Envoy Gateway only in its GatewayNamespace mode), and that proxy sends each
        request to the decode pod the EPP picked. A Gateway in this InferenceService's namespace
        adds nothing: admitting every pod of the namespace is for the user to ask for by name."""
        parent = self.route.parent.namespace if self.route is not None else None
        return tuple(sorted({*self.http_from_namespaces, *([parent] if parent else [])}))


def parse_gateway(raw: Any, errors: list[str]) -> GatewaySpec | None:
    """The section, or None when it is absent or its InferencePool is off."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        errors.append(f"{WHERE} must be a mapping {{inferencePool, httpRoute}}, got {str(raw)[:64]!r}")
        return None
    # An explicit null is an unset field here, as the API server would have it; the schema
    # defaults filled in everything else.
    pool = raw.get("inferencePool")
    pool = {} if pool is None else pool
    if not isinstance(pool, dict):
        errors.append(f"{WHERE}.inferencePool must be a mapping, got {str(pool)[:64]!r}")
        return None
    enabled = pool.get("enabled")
    enabled = True if enabled is None else enabled
    if not isinstance(enabled, bool):
        errors.append(f"{WHERE}.inferencePool.enabled must be true or false, got {str(enabled)[:40]!r}")
        return None
    route = _parse_route(raw.get("httpRoute"), errors)
    namespaces = _parse_namespaces(raw.get("httpFromNamespaces"), errors)
    if not enabled:
        if route is not None:
            errors.append(f"{WHERE}.httpRoute needs {WHERE}.inferencePool.enabled: the route's backend is the pool")
        return None
    port = pool.get("eppPort")
    port = _int(contract.EPP_PORT if port is None else port, f"{WHERE}.inferencePool.eppPort", errors, lo=1, hi=65535)
    _check_port(port, errors)
    mode = _choice(pool.get("failureMode"), FAILURE_MODES, f"{WHERE}.inferencePool.failureMode", errors)
    return GatewaySpec(epp_port=port, failure_mode=mode or FAILURE_MODES[0], route=route,
                       http_from_namespaces=namespaces)


def _check_port(port: int, errors: list[str]) -> None:
    # The router pod listens on the HTTP and admin ports already. spec.router.servicePort is free to
    # share the number: the EPP has a Service of its own (<name>-epp), apart from the client-facing one.
    taken = {contract.HTTP_PORT: "the router's http port", contract.ROUTER_ADMIN_PORT: "the router's admin port"}
    if port in taken:
        errors.append(f"{WHERE}.inferencePool.eppPort {port} is {taken[port]}; pick another port")


def _parse_route(raw: Any, errors: list[str]) -> HttpRouteSpec | None:
    where = f"{WHERE}.httpRoute"
    if raw is None:
        return None
    parent = raw.get("parentRef") if isinstance(raw, dict) else None
    if not isinstance(parent, dict) or parent.get("name") is None:
        errors.append(f"{where}.parentRef {{name[, namespace, sectionName]}} is required, got {str(raw)[:64]!r}")
        return None
    name = _name(parent.get("name"), DNS_SUBDOMAIN, f"{where}.parentRef.name", errors)
    ref = ParentRef(
        name=name or "",
        namespace=_name(parent.get("namespace"), DNS_LABEL, f"{where}.parentRef.namespace", errors),
        section_name=_name(parent.get("sectionName"), DNS_SUBDOMAIN, f"{where}.parentRef.sectionName", errors),
    )
    hostnames = raw.get("hostnames") or []
    if not isinstance(hostnames, list) or len(hostnames) > MAX_HOSTNAMES:
        errors.append(f"{where}.hostnames must be a list of at most {MAX_HOSTNAMES} hostnames, "
                      f"got {str(hostnames)[:64]!r}")
        hostnames = []
    # A null entry is checked as "" so it is reported, not dropped.
    checked = [_name("" if h is None else h, HOSTNAME, f"{where}.hostnames[{i}]", errors)
               for i, h in enumerate(hostnames)]
    timeout = raw.get("requestTimeout")
    timeout = _name(ROUTE_REQUEST_TIMEOUT if timeout is None else timeout, GATEWAY_DURATION,
                    f"{where}.requestTimeout", errors)
    return HttpRouteSpec(parent=ref, hostnames=tuple(h for h in checked if h is not None),
                         request_timeout=timeout or ROUTE_REQUEST_TIMEOUT)


def _parse_namespaces(raw: Any, errors: list[str]) -> tuple[str, ...]:
    where = f"{WHERE}.httpFromNamespaces"
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_HTTP_FROM_NAMESPACES:
        errors.append(f"{where} must be a list of at most {MAX_HTTP_FROM_NAMESPACES} namespace names, "
                      f"got {str(raw)[:64]!r}")
        return ()
    # A null entry is checked as "" so it is reported, not dropped.
    checked = [_name("" if n is None else n, DNS_LABEL, f"{where}[{i}]", errors) for i, n in enumerate(raw)]
    return tuple(n for n in checked if n is not None)
