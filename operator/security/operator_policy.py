"""What the cluster admin (through the chart) lets InferenceService authors do: operator-wide,
fixed at start-up, never read from a CR.

Whoever may create an InferenceService must not get host-level pods through the operator's
service account, so host access is off unless the chart turns it on; and the workers' HTTP
port is reachable only from the router, the operator and the namespaces named here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.operator import names
from tandem.operator.security.secret_env import referenced_secrets
from tandem.operator.security.template_allowlist import template_problems
from tandem.operator.spec.service_spec import ServiceSpec


@dataclass(frozen=True)
class OperatorPolicy:
    # hostPath model sources, and template overrides outside template_allowlist.py's allowlists
    # (host namespaces and ports, privileges, extra containers, foreign Secrets, command/args);
    # with it the merged pods also keep whatever security context the template gives them.
    allow_host_access: bool = False
    # Namespaces whose pods may reach the workers' HTTP port (metrics, OpenAI API): the
    # operator's own namespace (it scrapes metrics) and e.g. a monitoring namespace.
    http_from_namespaces: tuple[str, ...] = ()


# One line after the problems, not after each: what lifts the refusal.
HINT = ("the operator's pod policy refuses host access, identity changes, extra containers, capabilities "
        "beyond IPC_LOCK and Secrets its pods do not read (Helm value security.allowHostAccess lifts it)")


def policy_problems(svc: ServiceSpec, policy: OperatorPolicy) -> list[str]:
    """What in this spec the operator's policy refuses (empty: nothing)."""
    if policy.allow_host_access:
        return []
    bad = ["spec.model.hostPath"] if svc.model.host_path else []
    secrets = referenced_secrets(svc.name, svc.api_key)
    for role in names.ROLES:
        bad += template_problems(svc.role(role).template, f"spec.{role}.template", role, secrets)
    return ([f"{field} is refused" for field in bad] + [HINT]) if bad else []
