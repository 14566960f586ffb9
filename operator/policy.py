"""What the cluster admin (through the chart) lets InferenceService authors do: operator-wide,
fixed at start-up, never read from a CR.

Whoever may create an InferenceService must not get host-level pods through the operator's
service account, so host access is off unless the chart turns it on; and the workers' HTTP
port is reachable only from the router, the operator and the namespaces named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator import names
from tandem.operator.spec import ServiceSpec


@dataclass(frozen=True)
class OperatorPolicy:
    # hostPath model sources, and template overrides that reach the host or change identity
    # (hostNetwork/PID/IPC, privileged, root, serviceAccountName, command/args).
    allow_host_access: bool = False
    # Namespaces whose pods may reach the workers' HTTP port (metrics, OpenAI API): the
    # operator's own namespace (it scrapes metrics) and e.g. a monitoring namespace.
    http_from_namespaces: tuple[str, ...] = ()


HOST_FIELDS = ("hostNetwork", "hostPID", "hostIPC")
IDENTITY_FIELDS = ("serviceAccountName", "serviceAccount")
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
HINT = "the operator does not allow host access or identity changes (Helm value security.allowHostAccess)"


def _security_problems(ctx: Any, where: str) -> list[str]:
    if not isinstance(ctx, dict):
        return []
    bad = []
    if ctx.get("privileged") is True:
        bad.append(f"{where}.privileged")
    if ctx.get("runAsUser") == 0:
        bad.append(f"{where}.runAsUser: 0")
    # Added capabilities (e.g. IPC_LOCK for RDMA) stay allowed: they are the namespace's Pod
    # Security level's call, not a way onto the host.
    return bad


def _template_problems(template: dict[str, Any], where: str) -> list[str]:
    pod = template.get("spec")
    if not isinstance(pod, dict):
        return []
    bad = [f"{where}.spec.{key}" for key in HOST_FIELDS if pod.get(key)]
    bad += [f"{where}.spec.{key}" for key in IDENTITY_FIELDS if pod.get(key)]
    bad += _security_problems(pod.get("securityContext"), f"{where}.spec.securityContext")
    for i, volume in enumerate(pod.get("volumes") or []):
        if isinstance(volume, dict) and "hostPath" in volume:
            bad.append(f"{where}.spec.volumes[{i}].hostPath")
    for key in CONTAINER_LISTS:
        for i, c in enumerate(pod.get(key) or []):
            if not isinstance(c, dict):
                continue
            at = f"{where}.spec.{key}[{c.get('name', i)}]"
            # The command is the worker contract's; a replaced one runs anything under the pod's identity.
            bad += [f"{at}.{field}" for field in ("command", "args") if field in c]
            bad += _security_problems(c.get("securityContext"), f"{at}.securityContext")
    return bad


def policy_problems(svc: ServiceSpec, policy: OperatorPolicy) -> list[str]:
    """What in this spec the operator's policy refuses (empty: nothing)."""
    if policy.allow_host_access:
        return []
    bad = ["spec.model.hostPath"] if svc.model.host_path else []
    for role in names.ROLES:
        bad += _template_problems(svc.role(role).template, f"spec.{role}.template")
    return [f"{field} is refused: {HINT}" for field in bad]
