"""Pod template overrides cannot get around the operator's pod policy: one test per bypass that
worked before the allowlists (an extra container with capabilities, an unrelated Secret mounted,
a hostPort, a non-allowlisted volume type), each refused as a Forbidden condition, never a crash;
and what survives the merge runs under the restricted security context in every container."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest
from operator_fake_api import FakeApiServer, run_sync
from operator_support import EXAMPLES_DIR, load_example

from tandem.operator import names
from tandem.operator.reconcile import reconcile
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.spec.service_spec import SpecError

MOUNT = {"name": "decode", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}


def _with_template(cr: dict[str, Any], role: str, template: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(cr)
    out["spec"][role] = {**out["spec"].get(role, {}), "template": template}
    return out


def _refused(cr: dict[str, Any], *fragments: str) -> str:
    """The policy refuses `cr` (reconcile raises, sync reports Forbidden and applies nothing)."""
    with pytest.raises(SpecError) as err:
        reconcile(cr)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))
    server = FakeApiServer()
    result = run_sync(server, cr)
    assert isinstance(result.error, kopf.PermanentError) and server.calls == []
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Forbidden"
    assert all(f in degraded["message"] for f in fragments)
    return str(err.value)


# --- the four bypasses --------------------------------------------------------------------------

def test_extra_container_with_capabilities_is_refused(minimal_cr: dict[str, Any]) -> None:
    side = {"name": "side", "image": "busybox",
            "securityContext": {"capabilities": {"add": ["SYS_ADMIN", "NET_ADMIN"]}}}
    cr = _with_template(minimal_cr, "decode", {"spec": {"containers": [side]}})
    _refused(cr, "spec.decode.template.spec.containers[side]", "extra container",
             "capabilities.add [NET_ADMIN, SYS_ADMIN]")
    # An extra container is refused even with no securityContext at all (it would run with the
    # runtime's default capabilities), in the router too, and as an init container.
    _refused(_with_template(minimal_cr, "router", {"spec": {"containers": [{"name": "side", "image": "x"}]}}),
             "spec.router.template.spec.containers[side]")
    _refused(_with_template(minimal_cr, "prefill", {"spec": {"initContainers": [{"name": "i", "image": "x"}]}}),
             "spec.prefill.template.spec.initContainers[i]")


def test_worker_container_cannot_add_capabilities_beyond_ipc_lock(minimal_cr: dict[str, Any]) -> None:
    cr = _with_template(minimal_cr, "decode", {"spec": {"containers": [
        {"name": "decode", "securityContext": {"capabilities": {"add": ["IPC_LOCK", "SYS_PTRACE"]}}}]}})
    message = _refused(cr, "capabilities.add [SYS_PTRACE]")
    assert "IPC_LOCK" not in message.split("capabilities.add")[1].split("]")[0]


def test_secret_volume_of_an_unrelated_secret_is_refused(minimal_cr: dict[str, Any]) -> None:
    template = {"spec": {"volumes": [{"name": "x", "secret": {"secretName": "db-password"}}], "containers": [MOUNT]}}
    _refused(_with_template(minimal_cr, "decode", template), "spec.decode.template.spec.volumes[0].secret",
             "db-password")
    # The same Secret through a projected volume, an env var or envFrom.
    projected = {"name": "x", "projected": {"sources": [{"secret": {"name": "db-password"}}]}}
    _refused(_with_template(minimal_cr, "decode", {"spec": {"volumes": [projected]}}), "db-password")
    env = {"name": "decode", "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "db-password",
                                                                                    "key": "p"}}}]}
    _refused(_with_template(minimal_cr, "decode", {"spec": {"containers": [env]}}), "env[P]", "db-password")
    env_from = {"name": "decode", "envFrom": [{"secretRef": {"name": "db-password"}}]}
    _refused(_with_template(minimal_cr, "decode", {"spec": {"containers": [env_from]}}), "envFrom", "db-password")


def test_secrets_the_operator_references_may_be_mounted(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["apiKeySecretRef"] = {"name": "llama-key", "key": "token"}
    pd = names.pd_secret_name("llama3-8b")
    template = {"spec": {"volumes": [{"name": "x", "secret": {"secretName": "llama-key"}},
                                     {"name": "y", "projected": {"sources": [{"secret": {"name": pd}}]}}],
                         "containers": [MOUNT]}}
    assert reconcile(_with_template(cr, "decode", template))


def test_host_port_is_refused(minimal_cr: dict[str, Any]) -> None:
    template = {"spec": {"containers": [{"name": "decode", "ports": [
        {"name": "http", "containerPort": 8000, "hostPort": 80}]}]}}
    _refused(_with_template(minimal_cr, "decode", template), "ports[http].hostPort")


def test_host_path_volume_is_refused(minimal_cr: dict[str, Any]) -> None:
    template = {"spec": {"volumes": [{"name": "x", "hostPath": {"path": "/var/run"}}], "containers": [MOUNT]}}
    _refused(_with_template(minimal_cr, "decode", template), "spec.decode.template.spec.volumes[0].hostPath")


@pytest.mark.parametrize("source", [{"nfs": {"server": "10.0.0.1", "path": "/"}},
                                   {"csi": {"driver": "secrets-store.csi.k8s.io"}},
                                   {"iscsi": {"targetPortal": "10.0.0.1", "iqn": "x", "lun": 0}}],
                         ids=lambda s: next(iter(s)))
def test_volume_types_outside_the_allowlist_are_refused(minimal_cr: dict[str, Any], source: dict[str, Any]) -> None:
    template = {"spec": {"volumes": [{"name": "x", **source}], "containers": [MOUNT]}}
    _refused(_with_template(minimal_cr, "decode", template), f"volumes[0].{next(iter(source))}")


@pytest.mark.parametrize("context, says", [
    ({"seLinuxOptions": {"type": "spc_t"}}, "securityContext.seLinuxOptions"),
    ({"procMount": "Unmasked"}, "securityContext.procMount"),
    ({"allowPrivilegeEscalation": True}, "securityContext.allowPrivilegeEscalation"),
    ({"seccompProfile": {"type": "Unconfined"}}, "securityContext.seccompProfile"),
])
def test_security_context_keys_outside_the_allowlist_are_refused(minimal_cr: dict[str, Any],
                                                                  context: dict[str, Any], says: str) -> None:
    template = {"spec": {"containers": [{"name": "decode", "securityContext": context}]}}
    _refused(_with_template(minimal_cr, "decode", template), says)


def test_pod_level_sysctls_and_probe_hosts_are_refused(minimal_cr: dict[str, Any]) -> None:
    sysctls = {"spec": {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}}
    _refused(_with_template(minimal_cr, "decode", sysctls), "spec.securityContext.sysctls")
    probe = {"spec": {"containers": [{"name": "decode", "livenessProbe": {
        "httpGet": {"host": "169.254.169.254", "path": "/", "port": 80}}}]}}
    _refused(_with_template(minimal_cr, "decode", probe), "livenessProbe.httpGet.host")


def test_unnamed_list_items_are_refused(minimal_cr: dict[str, Any]) -> None:
    # A list with an unnamed item replaces the generated list whole instead of merging into it.
    template = {"spec": {"containers": [{"image": "busybox"}]}}
    _refused(_with_template(minimal_cr, "decode", template), "containers[0]", "name")


@pytest.mark.parametrize("template", [{"spec": 5}, {"metadata": "x"}, {"spec": {"containers": "abc",
                                                                              "volumes": [3]}}])
def test_malformed_templates_are_conditions_not_crashes(minimal_cr: dict[str, Any], template: Any) -> None:
    result = run_sync(FakeApiServer(), _with_template(minimal_cr, "decode", template))
    if result.error is not None:
        degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "spec.decode.template" in degraded["message"]


def test_every_bypass_is_allowed_when_the_chart_allows_host_access(minimal_cr: dict[str, Any]) -> None:
    side = {"name": "side", "image": "busybox", "ports": [{"containerPort": 1, "hostPort": 1}],
            "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}
    template = {"spec": {"containers": [side], "volumes": [{"name": "x", "secret": {"secretName": "db"}}]}}
    children = reconcile(_with_template(minimal_cr, "decode", template), OperatorPolicy(allow_host_access=True))
    (decode,) = [c for c in children if c["kind"] == "Deployment" and "-decode-" in c["metadata"]["name"]]
    pod = decode["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["decode", "side"]
    assert pod["containers"][1]["securityContext"] == side["securityContext"]  # the admin's call


# --- what the merge keeps: the restricted context, re-applied ---------------------------------------

def _pods(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["spec"]["template"]["spec"] for c in children if c["kind"] == "Deployment"]


def test_every_container_runs_restricted_after_the_merge(minimal_cr: dict[str, Any]) -> None:
    template = {"spec": {"securityContext": {"runAsUser": 2000, "fsGroup": 2000},
                         "containers": [{"name": "decode", "securityContext": {
                             "runAsUser": 2000, "readOnlyRootFilesystem": True,
                             "capabilities": {"add": ["IPC_LOCK"], "drop": ["NET_RAW"]}}}]}}
    for pod in _pods(reconcile(_with_template(minimal_cr, "decode", template))):
        for c in [*pod["containers"], *(pod.get("initContainers") or [])]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add") or []) <= {"IPC_LOCK"}
            assert not any(p.get("hostPort") for p in c.get("ports") or [])
    decode = [p for p in _pods(reconcile(_with_template(minimal_cr, "decode", template)))
              if p["containers"][0]["name"] == "decode"][0]
    assert decode["containers"][0]["securityContext"]["runAsUser"] == 2000  # a non-root UID is the author's
    assert decode["securityContext"] == {"runAsUser": 2000, "fsGroup": 2000}


def test_rdma_example_keeps_ipc_lock_under_the_default_policy() -> None:
    children = reconcile(load_example(EXAMPLES_DIR / "inferenceservice-rdma.yaml"))
    workers = [p for p in _pods(children) if p["containers"][0]["name"] in ("prefill", "decode")]
    assert len(workers) == 2
    for pod in workers:
        assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
