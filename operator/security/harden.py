"""The restricted security context, re-applied to a pod after the template override is merged in.

The merge (render/template_merge.py) replaces lists whole and maps key by key, so an override can undo what
the generated containers carry: `capabilities.drop: [NET_RAW]` replaces `drop: [ALL]` and
brings the runtime's default capabilities back. template_allowlist.py refuses what it can name;
this pass makes the rendered pod restricted whatever the override was: every container, init
and ephemeral ones included, gets the restricted context with only the allowlisted parts of
its own (a non-root UID/GID, IPC_LOCK), and host namespaces and host ports are dropped.
It runs only when the operator does not allow host access (operator_policy.py).
"""

from __future__ import annotations

import copy
from typing import Any

from tandem.operator.security.template_allowlist import (
    ALLOWED_CAPABILITIES,
    HOST_FIELDS,
    IDS,
    POD_ONLY,
    PROFILE_TYPES,
    PROFILES,
)

# A non-root UID the runtime image owns nothing as; the restricted Pod Security profile needs
# runAsNonRoot, and a kubelet can only verify it with a numeric user.
RUN_AS_USER = 1000


def restricted_security_context() -> dict[str, Any]:
    """Pod Security "restricted" for a container: nothing writable but its mounts."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


def _nonzero_ids(ctx: dict[str, Any]) -> dict[str, Any]:
    return {k: ctx[k] for k in IDS if isinstance(ctx.get(k), int) and not isinstance(ctx[k], bool) and ctx[k] > 0}


def container_context(ctx: Any) -> dict[str, Any]:
    """The restricted context, keeping from `ctx` only a non-root UID/GID and allowlisted capabilities."""
    own = ctx if isinstance(ctx, dict) else {}
    out = {**restricted_security_context(), **_nonzero_ids(own)}
    caps = own.get("capabilities") if isinstance(own.get("capabilities"), dict) else {}
    wanted = caps.get("add") if isinstance(caps.get("add"), list) else []
    added = sorted({c for c in wanted if c in ALLOWED_CAPABILITIES})
    if added:
        out["capabilities"] = {"drop": ["ALL"], "add": added}
    return out


def pod_context(ctx: Any) -> dict[str, Any]:
    """The pod-level context reduced to the allowlisted keys (containers override the rest anyway)."""
    own = ctx if isinstance(ctx, dict) else {}
    out = {k: copy.deepcopy(v) for k, v in own.items() if k in POD_ONLY}
    out.update(_nonzero_ids(own))
    for key in PROFILES:
        if isinstance(own.get(key), dict) and own[key].get("type") in PROFILE_TYPES:
            out[key] = copy.deepcopy(own[key])
    if own.get("runAsNonRoot") is True:
        out["runAsNonRoot"] = True
    return out


def harden_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """A copy of a merged pod spec with the restricted context re-applied everywhere."""
    if not isinstance(pod, dict):
        return pod  # not a pod spec at all: the API server rejects it, nothing here to harden
    out = copy.deepcopy(pod)
    for key in HOST_FIELDS:
        out.pop(key, None)
    if "securityContext" in out:
        out["securityContext"] = pod_context(out["securityContext"])
    for key in CONTAINER_LISTS:
        for c in out.get(key) or []:
            if not isinstance(c, dict):
                continue
            c["securityContext"] = container_context(c.get("securityContext"))
            for port in c.get("ports") or []:
                if isinstance(port, dict):
                    port.pop("hostPort", None)
                    port.pop("hostIP", None)
    return out


def harden_deployment(deployment: dict[str, Any]) -> dict[str, Any]:
    out = dict(deployment)
    spec = dict(out["spec"])
    template = dict(spec["template"])
    template["spec"] = harden_pod(template["spec"])
    spec["template"], out["spec"] = template, spec
    return out
