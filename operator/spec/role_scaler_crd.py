"""The RoleScaler CRD: the schema of the per-role /scale object (scaling/role_scaler.py renders
and reads the objects themselves). It sits with the InferenceService's schema so that every
CRD the operator serves is built in spec/ (crd.py's build_crds)."""

from __future__ import annotations

import copy
from typing import Any

from tandem.operator import names

KIND = "RoleScaler"
PLURAL = "rolescalers"
SHORT_NAME = "trs"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "required": ["service", "role"], "properties": {
            "service": {"type": "string", "description": "The InferenceService this scales."},
            "role": {"type": "string", "enum": list(names.WORKER_ROLES)},
            "replicas": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 1000,
                         "description": "Pods wanted; written by HPA/KEDA through /scale."},
        }},
        "status": {"type": "object", "properties": {
            "replicas": {"type": "integer", "format": "int32"},
            "readyReplicas": {"type": "integer", "format": "int32"},
            "desiredReplicas": {"type": "integer", "format": "int32",
                                "description": "What the operator runs after bounds and the P:D ratio."},
            "selector": {"type": "string"},
            "drivenBy": {"type": "string", "enum": ["operator", "external", "spec"]},
        }},
    },
}


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{names.GROUP}",
                     "labels": {names.LABEL_NAME: names.APP_NAME, names.LABEL_PART_OF: names.APP_NAME}},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": [SHORT_NAME], "categories": ["tandem"]},
            "versions": [{
                "name": names.VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": copy.deepcopy(SCHEMA)},
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": [
                    {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
                    {"name": "Wanted", "type": "integer", "jsonPath": ".spec.replicas"},
                    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                    {"name": "Driven-By", "type": "string", "jsonPath": ".status.drivenBy"},
                ],
            }],
        },
    }
