"""Object metadata every child carries: namespace, standard labels and the controller owner reference."""

from __future__ import annotations

from typing import Any

from tandem.operator import names
from tandem.operator.spec.service_spec import ServiceSpec

# Used by `render` when the CR has not been stored yet and so has no uid.
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def owner_reference(svc: ServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": svc.name,
        "uid": svc.uid or PLACEHOLDER_UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(svc: ServiceSpec, name: str, role: str | None = None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": svc.namespace,
        "labels": names.standard_labels(svc.name, role),
        "ownerReferences": [owner_reference(svc)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def is_owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)
