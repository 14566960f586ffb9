"""What a role's pod template override may hold when the operator does not allow host access.

Allowlists, not denylists, wherever Kubernetes keeps adding ways around one (volume types,
securityContext keys, capabilities): what is not listed is refused. The override is checked as
written; harden.py then re-applies the restricted security context to every container of the
merged pod, so whatever a check here misses still runs without privileges.

  containers        only the role's own (named like the role); initContainers and
                    ephemeralContainers not at all; every item named (an unnamed item
                    replaces the generated list whole instead of merging into it)
  securityContext   non-root UIDs/GIDs, fsGroup, RuntimeDefault/Localhost profiles, the
                    restricted values themselves, capabilities adding IPC_LOCK at most
  volumes           configMap, secret, emptyDir, persistentVolumeClaim, projected,
                    downwardAPI, ephemeral; Secrets only those the operator's pods read
  ports, probes     no hostPort/hostIP; no probe or hook `host` (the kubelet would call it)
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

# RDMA memory registration (examples/inferenceservice-rdma.yaml). Nothing else reaches the
# container: restricted Pod Security allows NET_BIND_SERVICE, but no Tandem process binds below 1024.
ALLOWED_CAPABILITIES = frozenset({"IPC_LOCK"})
VOLUME_TYPES = frozenset({"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "downwardAPI",
                          "ephemeral"})
PROJECTED_SOURCES = frozenset({"configMap", "secret", "downwardAPI", "serviceAccountToken", "clusterTrustBundle"})
HOST_FIELDS = ("hostNetwork", "hostPID", "hostIPC")
IDENTITY_FIELDS = ("serviceAccountName", "serviceAccount")
EXTRA_CONTAINER_LISTS = ("initContainers", "ephemeralContainers")
# securityContext keys whose only allowed value is the restricted one.
ENFORCED = {"allowPrivilegeEscalation": False, "privileged": False, "runAsNonRoot": True,
            "readOnlyRootFilesystem": True}
PROFILES = ("seccompProfile", "appArmorProfile")
PROFILE_TYPES = frozenset({"RuntimeDefault", "Localhost"})
IDS = ("runAsUser", "runAsGroup")
POD_ONLY = frozenset({"fsGroup", "fsGroupChangePolicy", "supplementalGroups", "supplementalGroupsPolicy"})
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def context_problems(ctx: Any, where: str, pod_level: bool) -> list[str]:
    """A container's (or, pod_level, the pod's) securityContext against the allowlist."""
    bad = []
    for key, value in _dict(ctx).items():
        if key in IDS:
            if value == 0:
                bad.append(f"{where}.{key}: 0")
        elif key in ENFORCED:
            if value is not ENFORCED[key]:
                bad.append(f"{where}.{key}: {json.dumps(value)}")
        elif key in PROFILES:
            if _dict(value).get("type") not in PROFILE_TYPES:
                bad.append(f"{where}.{key}")
        elif key == "capabilities" and not pod_level:
            added = {str(c) for c in _list(_dict(value).get("add"))} - ALLOWED_CAPABILITIES
            if added:
                bad.append(f"{where}.capabilities.add [{', '.join(sorted(added))}]")
        elif not (pod_level and key in POD_ONLY):
            bad.append(f"{where}.{key}")
    return bad


def _foreign(name: Any, secrets: Collection[str]) -> str | None:
    """Why a Secret reference is refused, or None when the operator's own pods read that Secret."""
    return None if name in secrets else f"Secret {name!r} is not one this InferenceService uses"


def _handler_hosts(c: dict[str, Any], at: str) -> list[str]:
    handlers = [(p, _dict(c.get(p))) for p in PROBES]
    handlers += [(f"lifecycle.{h}", _dict(_dict(c.get("lifecycle")).get(h))) for h in ("postStart", "preStop")]
    return [f"{at}.{where}.{kind}.host" for where, handler in handlers for kind in ("httpGet", "tcpSocket")
            if _dict(handler.get(kind)).get("host")]


def _env_problems(c: dict[str, Any], at: str, secrets: Collection[str]) -> list[str]:
    bad = []
    for e in _list(c.get("env")):
        ref = _dict(_dict(_dict(e).get("valueFrom")).get("secretKeyRef"))
        if ref and (why := _foreign(ref.get("name"), secrets)):
            bad.append(f"{at}.env[{_dict(e).get('name')}] ({why})")
    for i, source in enumerate(_list(c.get("envFrom"))):
        ref = _dict(_dict(source).get("secretRef"))
        if ref and (why := _foreign(ref.get("name"), secrets)):
            bad.append(f"{at}.envFrom[{i}] ({why})")
    return bad


def container_problems(c: dict[str, Any], at: str, secrets: Collection[str]) -> list[str]:
    # The command is the worker contract's; a replaced one runs anything under the pod's identity.
    bad = [f"{at}.{field}" for field in ("command", "args") if field in c]
    bad += context_problems(c.get("securityContext"), f"{at}.securityContext", pod_level=False)
    for i, port in enumerate(_list(c.get("ports"))):
        if _dict(port).get("hostPort") or _dict(port).get("hostIP"):
            bad.append(f"{at}.ports[{_dict(port).get('name', i)}].hostPort")
    return bad + _handler_hosts(c, at) + _env_problems(c, at, secrets)


def volume_problems(volumes: Any, where: str, secrets: Collection[str]) -> list[str]:
    bad = []
    for i, volume in enumerate(_list(volumes)):
        at = f"{where}[{i}]"
        if not _dict(volume).get("name"):
            bad.append(f"{at} (no name: an unnamed item replaces the generated volumes instead of merging)")
            continue
        bad += [f"{at}.{kind}" for kind in volume if kind != "name" and kind not in VOLUME_TYPES]
        if "secret" in volume and (why := _foreign(_dict(volume["secret"]).get("secretName"), secrets)):
            bad.append(f"{at}.secret ({why})")
        for j, projected in enumerate(_list(_dict(volume.get("projected")).get("sources"))):
            for kind, source in _dict(projected).items():
                if kind not in PROJECTED_SOURCES:
                    bad.append(f"{at}.projected.sources[{j}].{kind}")
                elif kind == "secret" and (why := _foreign(_dict(source).get("name"), secrets)):
                    bad.append(f"{at}.projected.sources[{j}].secret ({why})")
    return bad


def _containers(pod: dict[str, Any], where: str, own: str, secrets: Collection[str]) -> list[str]:
    bad = []
    for key in ("containers", *EXTRA_CONTAINER_LISTS):
        for i, c in enumerate(_list(pod.get(key))):
            if not _dict(c).get("name"):
                bad.append(f"{where}.spec.{key}[{i}] (no name: an unnamed item replaces the generated "
                           "containers instead of merging)")
                continue
            at = f"{where}.spec.{key}[{c['name']}]"
            if key != "containers" or c["name"] != own:
                bad.append(f"{at} (an extra container; the role's own is named {own!r})")
            bad += container_problems(c, at, secrets)
    return bad


def template_problems(template: Any, where: str, own: str, secrets: Collection[str]) -> list[str]:
    """The fields of one role's template override the policy refuses, as JSON-ish paths.
    `own` names the role's container; `secrets` are the Secrets the operator's pods read."""
    pod = _dict(_dict(template).get("spec"))
    bad = [f"{where}.spec.{key}" for key in (*HOST_FIELDS, *IDENTITY_FIELDS) if pod.get(key)]
    bad += context_problems(pod.get("securityContext"), f"{where}.spec.securityContext", pod_level=True)
    bad += volume_problems(pod.get("volumes"), f"{where}.spec.volumes", secrets)
    return bad + _containers(pod, where, own, secrets)
