"""End to end: the real kopf operator (a subprocess: `python -m tandem.operator run`) against kmock,
driven by the real kubectl. kmock is an API emulator, not a cluster: no pods start, no label
selectors, no strategic merge, no 409s; see operator_kmock.py for what the test subclass adds.

The operator runs as the chart runs it: with kopf peering (a ClusterKopfPeering named `tandem`)
and its metrics endpoint on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_support import EXAMPLES_DIR, REPO, container, load_example

from tandem.operator.reconcile import reconcile

pytest.importorskip("kmock", reason="pip install kmock pytest-asyncio (operator-test)")
from operator_kmock import (  # noqa: E402
    CLUSTER_PEERING_RESOURCE,
    CR_RESOURCE,
    HTTP_ROUTE_RESOURCE,
    INFERENCE_POOL_RESOURCE,
    ROLESCALER_RESOURCE,
    KmockCluster,
    condition,
    free_port,
    reconciles,
    scrape,
    wait_for,
)

# kmock reads its bundled resource list with a deprecated importlib API; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
DEPLOYMENTS = "apps/v1/deployments"
PEERING = "tandem"
# kopf's peer identity comes from POD_ID. A fixed one makes a restarted operator the same peer,
# as a restarted container in the same pod is, instead of a newcomer waiting for its own ghost.
LEADER_ID = "e2e-operator"


def expected_children(example: str = "inferenceservice-minimal.yaml") -> int:
    """How many children the operator applies for an example, outside a rollout."""
    return len(reconcile(load_example(EXAMPLES_DIR / example)))


N = expected_children()
N_AUTOSCALING = expected_children("inferenceservice-autoscaling.yaml")


class Env:
    def __init__(self, cluster: KmockCluster, kubeconfig: Path, kubectl: str, log: Path):
        self.cluster, self.kubectl_bin, self.log = cluster, kubectl, log
        self.env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        self.operator: subprocess.Popen[bytes] | None = None
        self.metrics_port = free_port()

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run([self.kubectl_bin, *args], env=self.env, input=stdin, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def spawn(self, log: Path, pod_id: str, metrics_port: int) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "tandem.operator", "run", "--all-namespaces", "--interval", "1",
                 "--peering", PEERING, "--metrics-port", str(metrics_port)],
                env=dict(self.env, POD_ID=pod_id), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def start_operator(self) -> None:
        self.operator = self.spawn(self.log, LEADER_ID, self.metrics_port)

    def peers(self) -> dict[str, Any]:
        found = [o for o in self.cluster.live(CLUSTER_PEERING_RESOURCE) if o["metadata"]["name"] == PEERING]
        return dict((found[0].get("status") or {}) if found else {})

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

    def deployment(self, name: str, role: str) -> dict[str, Any] | None:
        """A role's Deployment, found by its component label rather than a name (worker
        Deployment names carry a model-generation suffix); None unless exactly one."""
        found = [d for d in self.children(name)
                 if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == role]
        return found[0] if len(found) == 1 else None

    def all_children(self, name: str) -> list[dict[str, Any]]:
        resources = ("v1/configmaps", "v1/services", "v1/serviceaccounts", DEPLOYMENTS,
                     "rbac.authorization.k8s.io/v1/roles", "rbac.authorization.k8s.io/v1/rolebindings",
                     "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies",
                     ROLESCALER_RESOURCE, INFERENCE_POOL_RESOURCE, HTTP_ROUTE_RESOURCE)
        return [c for r in resources for c in self.children(name, r)]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, kubectl: str) -> Iterator[Env]:
    cluster = KmockCluster().start()
    tmp = tmp_path_factory.mktemp("kmock")
    e = Env(cluster, cluster.write_kubeconfig(tmp / "kubeconfig"), kubectl, tmp / "operator.log")
    # What the chart ships with leaderElection on; kopf only patches it, so it must exist first.
    e.kubectl("create", "--validate=false", "-f", "-",
              stdin=f"apiVersion: kopf.dev/v1\nkind: ClusterKopfPeering\nmetadata:\n  name: {PEERING}\n")
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
    children = wait_for(f"{N} children", lambda: (c := env.all_children("e2e-create")) and len(c) == N and c)
    uid = env.cr("e2e-create")["metadata"]["uid"]  # type: ignore[index]
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == uid for c in children)
    assert all(env.deployment("e2e-create", role) for role in ("prefill", "decode", "router"))
    assert len(env.children("e2e-create")) == 3
    (secret,) = env.children("e2e-create", "v1/secrets")  # the PD key: created by a plain POST, owned
    assert secret["metadata"]["ownerReferences"][0]["uid"] == uid and secret["immutable"] is True
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
        dep = env.deployment("e2e-patch", "decode")
        return dep if dep and dep["spec"]["replicas"] == 3 else None

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
        dep = env.deployment("e2e-ready", role)
        assert dep is not None, role
        env.kubectl("patch", "deployment", dep["metadata"]["name"], "--subresource=status", "--type=merge",
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
    wait_for("children after the fix", lambda: len(env.all_children("e2e-bad")) == N)


def test_delete_removes_the_cr_and_its_children(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-delete")
    wait_for("children", lambda: len(env.all_children("e2e-delete")) == N)
    env.kubectl("delete", "tisvc", "e2e-delete", "--wait=false")
    wait_for("CR gone (kopf released its finalizer)", lambda: env.cr("e2e-delete") is None)
    wait_for("children collected", lambda: env.all_children("e2e-delete") == [])
    wait_for("PD Secret collected", lambda: env.children("e2e-delete", "v1/secrets") == [])


def test_metrics_count_reconciles_by_result(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-metrics")
    env.create("inferenceservice-minimal.yaml", "e2e-metrics-bad", model={"servedName": "m", "uri": "hf://o/m"})

    def counted() -> dict[str, float] | None:
        samples = scrape(env.metrics_port)
        ok = samples.get('tandem_operator_reconcile_total{handler="reconcile",result="ok"}', 0)
        invalid = samples.get('tandem_operator_reconcile_total{handler="reconcile",result="invalid"}', 0)
        return samples if ok >= 1 and invalid >= 1 else None

    samples = wait_for("ok and invalid reconciles on /metrics", counted)
    assert samples['tandem_operator_errors_total{kind="invalid_spec"}'] >= 1
    assert samples['tandem_operator_reconcile_duration_seconds_count{handler="reconcile"}'] >= 2
    assert samples["tandem_operator_services{}"] >= 2
    wait_for("timer passes counted", lambda: scrape(env.metrics_port).get(
        'tandem_operator_reconcile_total{handler="timer",result="ok"}', 0) >= 1)
    assert not any(k.startswith("python_gc") for k in samples)  # a dedicated registry, ours only


def test_a_standby_replica_waits_then_takes_over(env: Env) -> None:
    log, port = env.log.with_name("standby.log"), free_port()
    standby = env.spawn(log, "e2e-standby", port)
    try:
        peers = wait_for("both replicas in the peering object",
                         lambda: (p := env.peers()) and {LEADER_ID, "e2e-standby"} <= set(p) and p)
        assert peers[LEADER_ID]["priority"] > peers["e2e-standby"]["priority"]  # the older one leads
        # kopf starts a peering replica paused and keeps it so while a higher priority lives
        # (it logs only transitions, so a standby that never ran logs nothing about it).
        env.create("inferenceservice-minimal.yaml", "e2e-led")
        wait_for("the leader's children", lambda: len(env.all_children("e2e-led")) == N)
        assert reconciles(scrape(port)) == 0 and "Resuming operations" not in log.read_text()
        env.stop_operator()  # graceful: kopf removes the leader from the peering object at once
        wait_for("standby resumed", lambda: "Resuming operations" in log.read_text(), timeout=20)
        env.create("inferenceservice-minimal.yaml", "e2e-taken-over")
        wait_for("the new leader's children", lambda: len(env.all_children("e2e-taken-over")) == N)
        assert reconciles(scrape(port)) >= 1
    finally:
        if standby.poll() is None:
            standby.send_signal(signal.SIGTERM)
            standby.wait(20)
        if env.operator is None:
            env.start_operator()
    wait_for("standby left the peering object", lambda: "e2e-standby" not in env.peers())


def test_operator_restart_midway_converges_without_duplicates(env: Env) -> None:
    env.create("inferenceservice-autoscaling.yaml", "e2e-restart")
    before = wait_for("children",
                      lambda: (c := env.all_children("e2e-restart")) and len(c) == N_AUTOSCALING and c)
    uids = {(c["kind"], c["metadata"]["name"]): c["metadata"]["uid"] for c in before}
    env.stop_operator(signal.SIGKILL)  # a crash: no cleanup, no graceful shutdown
    # Edits that keep the model generation (rollout/generation_hash.py), so they roll within the same
    # Deployments; an engine change would start a new generation by design.
    env.kubectl("patch", "tisvc", "e2e-restart", "--type=merge",
                "-p", '{"spec":{"prefill":{"replicas":3,"extraArgs":["--e2e-marker"]}}}')
    env.start_operator()

    def converged() -> list[dict[str, Any]] | None:
        dep = env.deployment("e2e-restart", "prefill")
        return env.children("e2e-restart") if dep and dep["spec"]["replicas"] == 3 else None

    wait_for("prefill at 3 after restart", converged, timeout=45)
    after = env.all_children("e2e-restart")
    assert len(after) == N_AUTOSCALING
    assert {(c["kind"], c["metadata"]["name"]): c["metadata"]["uid"] for c in after} == uids
    assert all(len(c["metadata"]["ownerReferences"]) == 1 for c in after)
    prefill = env.deployment("e2e-restart", "prefill")
    assert "--e2e-marker" in json.dumps(prefill["spec"]["template"]["spec"]["containers"])  # type: ignore[index]
    wait_for("observedGeneration 2",
             lambda: (c := env.cr("e2e-restart")) and c.get("status", {}).get("observedGeneration") == 2)
    # The autoscaler restarted from the edited spec (3 prefill pods), not from its pre-crash state.
    def autoscaler(c: dict[str, Any] | None) -> dict[str, Any]:
        return ((c or {}).get("status") or {}).get("autoscaler", {}).get("prefill", {})

    cr = wait_for("autoscaler state",
                  lambda: (c := env.cr("e2e-restart")) and autoscaler(c).get("specReplicas") == 3 and c)
    assert cr["status"]["autoscaler"]["prefill"]["replicas"] == 3


def _one(env: Env, name: str, resource: str) -> dict[str, Any] | None:
    found = env.children(name, resource)
    return found[0] if len(found) == 1 else None


def _router(env: Env, name: str) -> tuple[list[str], list[int]]:
    """The router container's command and its client-facing Service's port numbers."""
    dep = env.deployment(name, "router")
    (service,) = [s for s in env.children(name, "v1/services") if s["metadata"]["name"] == name]
    return (container(dep)["command"] if dep else []), [p["port"] for p in service["spec"]["ports"]]


def _named(env: Env, instance: str, name: str, resource: str) -> dict[str, Any] | None:
    found = [o for o in env.children(instance, resource) if o["metadata"]["name"] == name]
    return found[0] if found else None


def _epp_ports(env: Env, name: str) -> list[int]:
    """The port numbers of the Endpoint Picker's Service <name>-epp; [] while there is none."""
    service = _named(env, name, f"{name}-epp", "v1/services")
    return [p["port"] for p in service["spec"]["ports"]] if service else []


def test_gateway_section_create_update_and_remove(env: Env) -> None:
    route = {"parentRef": {"name": "inference-gateway", "namespace": "gateways"}, "hostnames": ["llm.example.com"]}
    env.create("inferenceservice-minimal.yaml", "e2e-gateway", gateway={"httpRoute": route})
    pool = wait_for("InferencePool", lambda: _one(env, "e2e-gateway", INFERENCE_POOL_RESOURCE))
    uid = env.cr("e2e-gateway")["metadata"]["uid"]  # type: ignore[index]
    assert pool["metadata"]["ownerReferences"][0]["uid"] == uid
    assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "e2e-gateway-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    http_route = wait_for("HTTPRoute", lambda: _one(env, "e2e-gateway", HTTP_ROUTE_RESOURCE))
    assert http_route["spec"]["rules"][0]["backendRefs"][0]["name"] == "e2e-gateway"
    assert http_route["spec"]["parentRefs"][0]["namespace"] == "gateways"
    cr = wait_for("GatewayConfigured", lambda: (c := env.cr("e2e-gateway"))
                  and condition(c, "GatewayConfigured").get("status") == "True" and c)
    assert condition(cr, "GatewayConfigured")["reason"] == "Applied"
    assert http_route["spec"]["rules"][0]["timeouts"] == {"request": "600s"}  # the CRD's default
    command, ports = _router(env, "e2e-gateway")
    assert command[command.index("--epp-port") + 1] == "9002" and ports == [80]  # the EPP is not the client's
    epp = _named(env, "e2e-gateway", "e2e-gateway-epp", "v1/services")
    assert epp is not None and epp["spec"]["type"] == "ClusterIP" and _epp_ports(env, "e2e-gateway") == [9002]
    assert epp["metadata"]["ownerReferences"][0]["uid"] == uid
    policy = _named(env, "e2e-gateway", "e2e-gateway-gateway", "networking.k8s.io/v1/networkpolicies")
    assert policy is not None and policy["metadata"]["ownerReferences"][0]["uid"] == uid
    assert policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "gateways"]

    # Update: another port and failure mode reach the pool, the router's flag and the EPP Service.
    env.kubectl("patch", "tisvc", "e2e-gateway", "--type=merge", "-p",
                json.dumps({"spec": {"gateway": {"inferencePool": {"eppPort": 9100, "failureMode": "FailOpen"}}}}))
    wait_for("pool on 9100, FailOpen", lambda: (p := _one(env, "e2e-gateway", INFERENCE_POOL_RESOURCE))
             and p["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "e2e-gateway-epp",
                                                    "port": {"number": 9100}, "failureMode": "FailOpen"})
    wait_for("EPP Service on 9100", lambda: _epp_ports(env, "e2e-gateway") == [9100])
    command, ports = _router(env, "e2e-gateway")
    assert command[command.index("--epp-port") + 1] == "9100" and ports == [80]

    # Removing the route deletes it, and the NetworkPolicy whose one namespace was the route's Gateway's;
    # the pool stays. Removing the section deletes the pool and the EPP Service.
    env.kubectl("patch", "tisvc", "e2e-gateway", "--type=merge", "-p", '{"spec":{"gateway":{"httpRoute":null}}}')
    wait_for("HTTPRoute deleted", lambda: env.children("e2e-gateway", HTTP_ROUTE_RESOURCE) == [])
    wait_for("NetworkPolicy deleted",
             lambda: _named(env, "e2e-gateway", "e2e-gateway-gateway", "networking.k8s.io/v1/networkpolicies") is None)
    assert _one(env, "e2e-gateway", INFERENCE_POOL_RESOURCE) is not None
    env.kubectl("patch", "tisvc", "e2e-gateway", "--type=merge", "-p", '{"spec":{"gateway":null}}')
    wait_for("InferencePool deleted", lambda: env.children("e2e-gateway", INFERENCE_POOL_RESOURCE) == [])
    wait_for("EPP Service deleted", lambda: _epp_ports(env, "e2e-gateway") == [])
    wait_for("router without the EPP", lambda: "--epp-port" not in _router(env, "e2e-gateway")[0])
    wait_for("GatewayConfigured Disabled",
             lambda: condition(env.cr("e2e-gateway"), "GatewayConfigured").get("reason") == "Disabled")
    assert len(env.all_children("e2e-gateway")) == N


def test_gateway_children_go_with_the_cr(env: Env) -> None:
    env.create("inferenceservice-minimal.yaml", "e2e-gateway-gc", gateway={"httpRoute": {"parentRef": {"name": "gw"}}})
    wait_for("pool and route", lambda: _one(env, "e2e-gateway-gc", INFERENCE_POOL_RESOURCE)
             and _one(env, "e2e-gateway-gc", HTTP_ROUTE_RESOURCE))
    env.kubectl("delete", "tisvc", "e2e-gateway-gc", "--wait=false")
    wait_for("children collected", lambda: env.all_children("e2e-gateway-gc") == [])


def test_a_cluster_without_the_gie_crd_gets_a_condition_not_a_crash(env: Env) -> None:
    env.cluster.withhold(INFERENCE_POOL_RESOURCE)
    try:
        env.create("inferenceservice-minimal.yaml", "e2e-no-gie", gateway={})
        cr = wait_for("GatewayUnavailable", lambda: (c := env.cr("e2e-no-gie"))
                      and condition(c, "GatewayConfigured").get("reason") == "GatewayUnavailable" and c)
        assert "no inference.networking.k8s.io/v1 InferencePool CRD" in condition(cr, "GatewayConfigured")["message"]
        assert condition(cr, "Degraded").get("reason") != "ApplyFailed"
        # The rest: every child of the plain service, and the EPP Service (a core kind).
        wait_for("the rest of the children", lambda: len(env.all_children("e2e-no-gie")) == N + 1)
        assert _epp_ports(env, "e2e-no-gie") == [9002]
        assert env.operator is not None and env.operator.poll() is None
    finally:
        env.cluster.withhold(INFERENCE_POOL_RESOURCE, False)
    # Installing the CRD heals the service on a timer pass, with no edit of the CR.
    wait_for("pool after the CRD appears", lambda: _one(env, "e2e-no-gie", INFERENCE_POOL_RESOURCE))
    wait_for("GatewayConfigured True",
             lambda: condition(env.cr("e2e-no-gie"), "GatewayConfigured").get("status") == "True")
