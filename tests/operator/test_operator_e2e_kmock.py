"""End to end: the real kopf operator (a subprocess: `python -m tandem.operator run`) against kmock,
driven by the real kubectl. kmock is an API emulator, not a cluster: no pods start, no label
selectors, no strategic merge, no 409s; see operator_kmock.py for what the test subclass adds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from operator_support import EXAMPLES_DIR, REPO

pytest.importorskip("kmock", reason="pip install kmock pytest-asyncio (operator-test)")
from operator_kmock import CR_RESOURCE, KmockCluster  # noqa: E402

# kmock reads its bundled resource list with a deprecated importlib API; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
T = TypeVar("T")
DEPLOYMENTS = "apps/v1/deployments"


class Env:
    def __init__(self, cluster: KmockCluster, kubeconfig: Path, kubectl: str, log: Path):
        self.cluster, self.kubectl_bin, self.log = cluster, kubectl, log
        self.env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        self.operator: subprocess.Popen[bytes] | None = None

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run([self.kubectl_bin, *args], env=self.env, input=stdin, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def start_operator(self) -> None:
        with self.log.open("ab") as log:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "tandem.operator", "run", "--all-namespaces", "--interval", "1"],
                env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def stop_operator(self, sig: int = signal.SIGTERM) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.send_signal(sig)
            self.operator.wait(20)
        self.operator = None

    def create(self, example: str, name: str, **spec: Any) -> dict[str, Any]:
        cr = yaml.safe_load((EXAMPLES_DIR / example).read_text())
        cr["metadata"] = {"name": name, "namespace": "default"}
        cr["spec"].update(spec)
        self.kubectl("create", "--validate=false", "-f", "-", stdin=yaml.safe_dump(cr))
        return cr

    def cr(self, name: str) -> dict[str, Any] | None:
        found = [o for o in self.cluster.live(CR_RESOURCE, "default") if o["metadata"]["name"] == name]
        return found[0] if found else None

    def children(self, name: str, resource: str = DEPLOYMENTS) -> list[dict[str, Any]]:
        return [o for o in self.cluster.live(resource, "default")
                if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == name]

    def all_children(self, name: str) -> list[dict[str, Any]]:
        resources = ("v1/configmaps", "v1/services", "v1/serviceaccounts", DEPLOYMENTS,
                     "rbac.authorization.k8s.io/v1/roles", "rbac.authorization.k8s.io/v1/rolebindings",
                     "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies")
        return [c for r in resources for c in self.children(name, r)]


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((cr or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, kubectl: str) -> Iterator[Env]:
    cluster = KmockCluster().start()
    tmp = tmp_path_factory.mktemp("kmock")
    e = Env(cluster, cluster.write_kubeconfig(tmp / "kubeconfig"), kubectl, tmp / "operator.log")
    e.start_operator()
    try:
        yield e
    finally:
        e.stop_operator()
        cluster.stop()
        if e.log.exists():
            sys.stdout.write(e.log.read_text()[-4000:])  # shown by pytest on failure


def test_create_gives_children_owner_refs_and_status(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-create")
    children = wait_for("14 children", lambda: (c := env.all_children("e2e-create")) and len(c) == 14 and c)
    uid = env.cr("e2e-create")["metadata"]["uid"]  # type: ignore[index]
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == uid for c in children)
    assert {c["metadata"]["name"] for c in env.children("e2e-create")} == {
        "e2e-create-prefill", "e2e-create-decode", "e2e-create-router"}
    cr = wait_for("status", lambda: (c := env.cr("e2e-create")) and condition(c, "Progressing") and c)
    assert cr["status"]["url"] == "http://e2e-create.default.svc.cluster.local"
    assert condition(cr, "Ready")["status"] == "False"  # no pods exist in an emulator
    assert cr["metadata"]["finalizers"] == ["tandem.dev/finalizer"]
    listed = json.loads(env.kubectl("get", "tisvc", "-o", "json"))
    assert "e2e-create" in {i["metadata"]["name"] for i in listed["items"]}


def test_patching_replicas_changes_the_deployment(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-patch")
    wait_for("decode deployment", lambda: env.children("e2e-patch"))
    env.kubectl("patch", "tisvc", "e2e-patch", "--type=merge", "-p", '{"spec":{"decode":{"replicas":3}}}')

    def scaled() -> dict[str, Any] | None:
        dep = [d for d in env.children("e2e-patch") if d["metadata"]["name"] == "e2e-patch-decode"]
        return dep[0] if dep and dep[0]["spec"]["replicas"] == 3 else None

    wait_for("decode replicas 3", scaled)
    cr = wait_for("observedGeneration 2",
                  lambda: (c := env.cr("e2e-patch")) and c.get("status", {}).get("observedGeneration") == 2
                  and c)
    assert cr["status"]["decode"]["desiredReplicas"] == 3


def test_ready_needs_prefill_decode_and_router(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-ready")
    wait_for("deployments", lambda: len(env.children("e2e-ready")) == 3)

    def mark_ready(role: str) -> None:
        status = {"status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1,
                             "updatedReplicas": 1}}
        env.kubectl("patch", "deployment", f"e2e-ready-{role}", "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))

    mark_ready("prefill")
    mark_ready("router")
    cr = wait_for("DecodeNotReady", lambda: (c := env.cr("e2e-ready"))
                  and condition(c, "Ready").get("reason") == "DecodeNotReady" and c)
    assert condition(cr, "PrefillReady")["status"] == "True"
    mark_ready("decode")
    cr = wait_for("Ready", lambda: (c := env.cr("e2e-ready"))
                  and condition(c, "Ready").get("status") == "True" and c)
    assert condition(cr, "Ready")["reason"] == "PrefillDecodePathReady"
    assert condition(cr, "Degraded")["status"] == "False"


def test_invalid_spec_is_degraded_not_a_crash(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-bad", model={"servedName": "m", "uri": "hf://org/m"})
    cr = wait_for("Degraded", lambda: (c := env.cr("e2e-bad"))
                  and condition(c, "Degraded").get("status") == "True" and c)
    assert condition(cr, "Degraded")["reason"] == "InvalidSpec"
    assert "reserved" in condition(cr, "Degraded")["message"]
    assert env.all_children("e2e-bad") == []
    assert env.operator is not None and env.operator.poll() is None
    fix = {"spec": {"model": {"uri": None, "pvc": {"claimName": "models"}}}}
    env.kubectl("patch", "tisvc", "e2e-bad", "--type=merge", "-p", json.dumps(fix))
    wait_for("recovered", lambda: condition(env.cr("e2e-bad"), "Degraded").get("status") == "False")
    wait_for("children after the fix", lambda: len(env.all_children("e2e-bad")) == 14)


def test_delete_removes_the_cr_and_its_children(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-delete")
    wait_for("children", lambda: len(env.all_children("e2e-delete")) == 14)
    env.kubectl("delete", "tisvc", "e2e-delete", "--wait=false")
    wait_for("CR gone (kopf released its finalizer)", lambda: env.cr("e2e-delete") is None)
    wait_for("children collected", lambda: env.all_children("e2e-delete") == [])


def test_operator_restart_midway_converges_without_duplicates(env: Env) -> None:
    env.create("inferenceservice-autoscaling.yaml", "e2e-restart")
    before = wait_for("children", lambda: (c := env.all_children("e2e-restart")) and len(c) == 14 and c)
    uids = {(c["kind"], c["metadata"]["name"]): c["metadata"]["uid"] for c in before}
    env.stop_operator(signal.SIGKILL)  # a crash: no cleanup, no graceful shutdown
    env.kubectl("patch", "tisvc", "e2e-restart", "--type=merge",
                "-p", '{"spec":{"prefill":{"replicas":3},"engine":{"pageSize":32}}}')
    env.start_operator()

    def converged() -> list[dict[str, Any]] | None:
        deps = {d["metadata"]["name"]: d for d in env.children("e2e-restart")}
        dep = deps.get("e2e-restart-prefill")
        return list(deps.values()) if dep and dep["spec"]["replicas"] == 3 else None

    wait_for("prefill at 3 after restart", converged, timeout=45)
    after = env.all_children("e2e-restart")
    assert len(after) == 14
    assert {(c["kind"], c["metadata"]["name"]): c["metadata"]["uid"] for c in after} == uids
    assert all(len(c["metadata"]["ownerReferences"]) == 1 for c in after)
    config = [c for c in after if c["kind"] == "ConfigMap"][0]
    assert "page_size: 32" in config["data"]["prefill.yaml"]
    wait_for("observedGeneration 2",
             lambda: (c := env.cr("e2e-restart")) and c.get("status", {}).get("observedGeneration") == 2)
    # The autoscaler restarted from the edited spec (3 prefill pods), not from its pre-crash state.
    def autoscaler(c: dict[str, Any] | None) -> dict[str, Any]:
        return ((c or {}).get("status") or {}).get("autoscaler", {}).get("prefill", {})

    cr = wait_for("autoscaler state",
                  lambda: (c := env.cr("e2e-restart")) and autoscaler(c).get("specReplicas") == 3 and c)
    assert cr["status"]["autoscaler"]["prefill"]["replicas"] == 3
