"""The InferenceService CustomResourceDefinition.

One scale subresource per CRD is all the API allows, so `/scale` drives the decode
role: decode is the role whose count follows concurrent sequences, and the operator
keeps prefill inside the configured P:D ratio of whatever decode count results.
`kubectl scale tisvc/x --replicas=N`, an HPA or KEDA therefore set spec.decode.replicas.
"""

from __future__ import annotations

import copy
from typing import Any

from tandem.operator import names
from tandem.operator.spec import role_scaler_crd
from tandem.operator.spec.spec_schema import ROOT_SCHEMA

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.readyReplicas",
     "description": "Ready prefill pods"},
    {"name": "Decode", "type": "integer", "jsonPath": ".status.decode.readyReplicas",
     "description": "Ready decode pods"},
    {"name": "Router", "type": "integer", "jsonPath": ".status.router.readyReplicas",
     "description": "Ready router pods"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.servedName", "priority": 1},
    {"name": "TTFT-p95", "type": "number", "jsonPath": ".status.slo.ttftP95Seconds", "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

SCALE_SUBRESOURCE = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.replicas",
    "labelSelectorPath": ".status.decode.selector",
}


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{names.PLURAL}.{names.GROUP}",
            "labels": {names.LABEL_NAME: names.APP_NAME, names.LABEL_PART_OF: names.APP_NAME},
        },
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": [names.SHORT_NAME],
                "categories": ["tandem"],
            },
            "versions": [{
                "name": names.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": copy.deepcopy(ROOT_SCHEMA)},
                "subresources": {"status": {}, "scale": dict(SCALE_SUBRESOURCE)},
                "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
            }],
        },
    }


def spec_schema() -> dict[str, Any]:
    """The openAPIV3Schema, for validating CRs offline with jsonschema."""
    return copy.deepcopy(ROOT_SCHEMA)


def build_crds() -> list[dict[str, Any]]:
    """Every CRD the operator serves: InferenceService, and RoleScaler (a /scale per worker role)."""
    return [build_crd(), role_scaler_crd.build_crd()]
