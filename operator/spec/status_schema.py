"""The openAPIV3Schema of the InferenceService status (written only by the operator)."""

from __future__ import annotations

from typing import Any

CONDITION_TYPES = (
    "PrefillReady", "DecodeReady", "RouterReady", "Ready", "Progressing", "Degraded", "WorkersFailing",
    "ScalingActive", "GatewayConfigured", "SpecWarnings",
)

_INT = {"type": "integer", "format": "int32"}
_STR = {"type": "string"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_TIME = {"type": "string", "format": "date-time"}

CONDITION: dict[str, Any] = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "enum": list(CONDITION_TYPES)},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": _STR,
        "message": _STR,
        "lastTransitionTime": _TIME,
        "observedGeneration": {"type": "integer", "format": "int64"},
    },
}

ROLE_STATUS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "desiredReplicas": _INT,
        "replicas": _INT,
        "readyReplicas": _INT,
        "updatedReplicas": _INT,
        "selector": {**_STR, "description": "Label selector of the role's pods (feeds /scale)."},
    },
}

SLO_STATUS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ttftP95Seconds": _NUM,
        "ttftTargetSeconds": _NUM,
        "ttftAttained": _BOOL,
        "itlP95Seconds": _NUM,
        "itlTargetSeconds": _NUM,
        "itlAttained": _BOOL,
        "measuredAt": _TIME,
    },
}

AUTOSCALER_ROLE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "replicas": _INT,
        "signal": _STR,
        "value": _NUM,
        "target": _NUM,
        "lastScaleUpTime": _TIME,
        "lastScaleDownTime": _TIME,
        "specReplicas": {**_INT,
                         "description": "spec replicas this state was derived from; a change resets it."},
    },
}

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "url": _STR,
        "observedGeneration": {"type": "integer", "format": "int64"},
        "prefill": ROLE_STATUS,
        "decode": ROLE_STATUS,
        "router": ROLE_STATUS,
        "conditions": {
            "type": "array",
            "items": CONDITION,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
        "slo": SLO_STATUS,
        "rollout": {
            "type": "object",
            "properties": {
                "generation": {**_STR, "description": "Model generation the spec asks for."},
                "oldGenerations": {"type": "array", "items": {
                    "type": "object",
                    "properties": {"generation": _STR, "prefill": _INT, "decode": _INT},
                }, "description": "Generations still draining, with their pods."},
            },
        },
        "autoscaler": {
            "type": "object",
            "properties": {
                "prefill": AUTOSCALER_ROLE,
                "decode": AUTOSCALER_ROLE,
                "ratio": _NUM,
                "lastDecision": _STR,
            },
        },
    },
}
