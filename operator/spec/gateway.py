"""spec.gateway: serving through a Gateway API Inference Extension (GIE) gateway.

The parsed section says what render/gateway.py builds (an InferencePool, and optionally an
HTTPRoute from a Gateway to it) and which port the router's Endpoint Picker listens on.
The parser appends problems to `errors`, as every section parser does (sections.py); it
repeats the schema's bounds because a CR that skipped admission may hold anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem import worker_contract as contract
from tandem.operator.spec.field_checks import DNS_LABEL, DNS_SUBDOMAIN, HOSTNAME, _choice, _int, _name
from tandem.operator.spec.spec_schema import FAILURE_MODES, MAX_HOSTNAMES

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


@dataclass(frozen=True)
class GatewaySpec:
    """Present only when an InferencePool is wanted (inferencePool.enabled)."""

    epp_port: int
    failure_mode: str  # one of FAILURE_MODES
    route: HttpRouteSpec | None = None


def parse_gateway(raw: Any, router_service_port: int, errors: list[str]) -> GatewaySpec | None:
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
    if not enabled:
        if route is not None:
            errors.append(f"{WHERE}.httpRoute needs {WHERE}.inferencePool.enabled: the route's backend is the pool")
        return None
    port = pool.get("eppPort")
    port = _int(contract.EPP_PORT if port is None else port, f"{WHERE}.inferencePool.eppPort", errors, lo=1, hi=65535)
    _check_port(port, router_service_port, errors)
    mode = _choice(pool.get("failureMode"), FAILURE_MODES, f"{WHERE}.inferencePool.failureMode", errors)
    return GatewaySpec(epp_port=port, failure_mode=mode or FAILURE_MODES[0], route=route)


def _check_port(port: int, router_service_port: int, errors: list[str]) -> None:
    # The router pod listens on the HTTP and admin ports already, and the router Service would
    # carry two ports of one number: either way the EPP could not be reached there.
    taken = {contract.HTTP_PORT: "the router's http port", contract.ROUTER_ADMIN_PORT: "the router's admin port",
             router_service_port: "spec.router.servicePort"}
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
    return HttpRouteSpec(parent=ref, hostnames=tuple(h for h in checked if h is not None))
