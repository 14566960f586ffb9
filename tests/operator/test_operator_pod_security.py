"""Every pod the operator renders passes Pod Security "restricted" (the rules of the Kubernetes
pod-security-admission `restricted` level, checked here one by one), for every example whose
model source is not hostPath (hostPath volumes are outside "restricted" by definition)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_support import EXAMPLES_DIR, load_example, render, short_name

_ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                    "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The restricted profile's checks (pod-security-admission v1.30, 'restricted' level)."""
    out = []
    pod_sc = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(f"{flag} is set")
    for vol in pod.get("volumes") or []:
        kind = next(k for k in vol if k != "name")
        if kind not in _ALLOWED_VOLUMES:
            out.append(f"volume {vol['name']} is {kind}")
    for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
        sc, where = c.get("securityContext") or {}, f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{where} is privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where} does not set allowPrivilegeEscalation: false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where} does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where} adds capabilities {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            out.append(f"{where} may run as root")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{where} runs as UID 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where} has no RuntimeDefault/Localhost seccomp profile")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where} uses hostPort {port['hostPort']}")
    return out


def _pods(cr: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(short_name(o), o["spec"]["template"]["spec"]) for o in render(cr)
            if o["kind"] == "Deployment"]


# Outside "restricted" on purpose: hostPath model sources, and RDMA, whose template adds IPC_LOCK
# (memory registration for the NIC) and so needs a namespace at the "privileged" level.
EXAMPLES = sorted(p for p in EXAMPLES_DIR.glob("inferenceservice-*.yaml")
                  if "hostpath" not in p.name and "rdma" not in p.name)


def test_rdma_example_breaks_restricted_only_by_ipc_lock() -> None:
    for name, pod in _pods(load_example(EXAMPLES_DIR / "inferenceservice-rdma.yaml")):
        assert all("IPC_LOCK" in v for v in restricted_violations(pod)), name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_pods_pass_restricted(path) -> None:
    pods = _pods(load_example(path))
    assert {name.rsplit("-", 1)[-1] for name, _ in pods} >= {"prefill", "decode", "router"}
    for name, pod in pods:
        assert restricted_violations(pod) == [], name


def test_the_checker_catches_what_restricted_forbids(minimal_cr) -> None:
    _, pod = _pods(minimal_cr)[0]
    assert restricted_violations(pod) == []
    bad = {**pod, "hostNetwork": True, "volumes": [*pod.get("volumes", []), {"name": "h", "hostPath": {"path": "/"}}],
           "containers": [{**pod["containers"][0], "securityContext": {"privileged": True, "runAsUser": 0}}]}
    found = " ".join(restricted_violations(bad))
    for what in ("hostNetwork", "hostPath", "privileged", "allowPrivilegeEscalation", "ALL", "UID 0", "seccomp"):
        assert what in found, what
