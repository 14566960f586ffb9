"""RoleScaler: one small object per worker role with its own /scale, for HPA, KEDA or `kubectl scale`.

A CRD has one scale subresource, and the InferenceService's drives decode; so each worker
role gets a child `RoleScaler` named `<name>-<role>` (Dynamo ships one scaling adapter per
service the same way). For a role listed in spec.autoscaling.external, its spec.replicas
is the role's count (clamped to the role's bounds, the P:D ratio still applied); for any
other role the operator drives the count itself and mirrors it into spec.replicas.

spec.replicas is never part of what the operator applies: an HPA owns that field after the
first write, and a server-side apply that carried it would take it back. It is set once,
with a merge patch, when the object has none.
"""

from __future__ import annotations

from typing import Any

from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.spec.role_scaler_crd import KIND, SCHEMA, build_crd
from tandem.operator.spec.service_spec import ServiceSpec

__all__ = ["KIND", "SCHEMA", "build_crd", "role_scaler", "scaler_name"]

def scaler_name(instance: str, role: str) -> str:
    return names.role_name(instance, role)


def role_scaler(svc: ServiceSpec, role: str) -> dict[str, Any]:
    """The applied part: identity only (no spec.replicas, see the module docstring)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": KIND,
        "metadata": child_meta(svc, scaler_name(svc.name, role), role),
        "spec": {"service": svc.name, "role": role},
    }


def wanted(obj: dict[str, Any] | None) -> int | None:
    """spec.replicas as written through /scale, or None when absent or malformed."""
    value = ((obj or {}).get("spec") or {}).get("replicas")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def driver(svc: ServiceSpec, role: str) -> str:
    if role in svc.autoscaling.external:
        return "external"
    return "operator" if svc.autoscaling.enabled else "spec"


def hpa_conflicts(svc: ServiceSpec, hpas: list[dict[str, Any]]) -> list[str]:
    """HPAs (KEDA makes HPAs too) that would fight the operator over a role's count."""
    ours = {(KIND, scaler_name(svc.name, r)): r for r in names.WORKER_ROLES}
    out = []
    for hpa in hpas:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        kind, target, who = ref.get("kind"), str(ref.get("name", "")), f"HPA {hpa['metadata']['name']}"
        if kind == "Deployment" and target.startswith(f"{svc.name}-") and any(
                target.startswith(f"{svc.name}-{r}") for r in names.ROLES):
            out.append(f"{who} scales Deployment {target}, which the operator owns; target RoleScaler "
                       f"{svc.name}-<role> and list the role in spec.autoscaling.external")
        elif (kind, target) in ours and ours[(kind, target)] not in svc.autoscaling.external:
            out.append(f"{who} scales RoleScaler {target}, but spec.autoscaling.external does not list "
                       f"{ours[(kind, target)]}: the operator drives that role")
        elif kind == names.KIND and target == svc.name and svc.autoscaling.enabled:
            out.append(f"{who} scales the InferenceService's decode count while the built-in autoscaler "
                       f"drives it; disable one, or target RoleScaler {svc.name}-decode with it listed "
                       "in spec.autoscaling.external")
    return out


async def read_scalers(api: Any, svc: ServiceSpec) -> dict[str, dict[str, Any] | None]:
    return {role: await api.get(names.API_VERSION, KIND, svc.namespace, scaler_name(svc.name, role))
            for role in names.WORKER_ROLES}


async def write_scalers(api: Any, svc: ServiceSpec, found: dict[str, dict[str, Any] | None],
                        desired: dict[str, int], observed: dict[str, Any]) -> None:
    """Seed spec.replicas once, mirror the operator's count for roles it drives, and report status."""
    for role in names.WORKER_ROLES:
        name, drives = scaler_name(svc.name, role), driver(svc, role)
        current = wanted(found.get(role))
        if current is None or (drives != "external" and current != desired[role]):
            await api.merge_patch(names.API_VERSION, KIND, svc.namespace, name,
                                  {"spec": {"replicas": desired[role]}})
        status = {
            "replicas": observed[role].replicas, "readyReplicas": observed[role].ready,
            "desiredReplicas": desired[role], "drivenBy": drives,
            "selector": names.selector_string(names.selector_labels(svc.name, role)),
        }
        if ((found.get(role) or {}).get("status") or {}) != status:
            await api.merge_patch(names.API_VERSION, KIND, svc.namespace, name, {"status": status},
                                  subresource="status")
