"""The operator's policy: host access and identity changes are refused (Degraded, nothing applied)
unless the chart allows them."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest
from operator_fake_api import FakeApiServer, run_sync
from operator_support import EXAMPLES_DIR, load_example

from tandem.operator.reconcile import reconcile
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.spec.service_spec import SpecError

REFUSED = {
    "hostNetwork": {"spec": {"hostNetwork": True}},
    "hostPID": {"spec": {"hostPID": True}},
    "hostIPC": {"spec": {"hostIPC": True}},
    "serviceAccountName": {"spec": {"serviceAccountName": "cluster-admin-sa"}},
    "volumes[0].hostPath": {"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}},
    "securityContext.runAsUser: 0": {"spec": {"securityContext": {"runAsUser": 0}}},
    "privileged": {"spec": {"containers": [{"name": "decode", "securityContext": {"privileged": True}}]}},
    "[decode].command": {"spec": {"containers": [{"name": "decode", "command": ["sh", "-c", "id"]}]}},
    "[decode].args": {"spec": {"containers": [{"name": "decode", "args": ["--x"]}]}},
    "[side].securityContext.runAsUser: 0": {"spec": {"containers": [
        {"name": "side", "image": "busybox", "securityContext": {"runAsUser": 0}}]}},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_host_level_overrides_are_refused(minimal_cr: dict[str, Any], field: str) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["decode"] = {"template": REFUSED[field]}
    with pytest.raises(SpecError, match="security.allowHostAccess") as err:
        reconcile(cr)
    assert field in str(err.value)
    assert reconcile(cr, OperatorPolicy(allow_host_access=True))  # allowed when the chart says so


def test_harmless_overrides_pass(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["decode"] = {"template": {"spec": {"priorityClassName": "high", "containers": [
        {"name": "decode", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}}}
    assert reconcile(cr)


def test_host_path_models_are_refused_through_sync() -> None:
    cr = load_example(EXAMPLES_DIR / "inferenceservice-cpu-hostpath.yaml")
    server = FakeApiServer()
    result = run_sync(server, cr)
    assert isinstance(result.error, kopf.PermanentError) and server.calls == []
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "Forbidden" and "spec.model.hostPath" in degraded["message"]
    allowed = run_sync(FakeApiServer(), cr, policy=OperatorPolicy(allow_host_access=True))
    assert allowed.error is None


def test_render_refuses_host_access_unless_asked(capsys) -> None:
    import argparse

    from tandem.operator.cli import render_command

    path = str(EXAMPLES_DIR / "inferenceservice-cpu-hostpath.yaml")
    assert render_command(argparse.Namespace(filename=path, allow_host_access=False)) == 1
    assert "security.allowHostAccess" in capsys.readouterr().err
    assert render_command(argparse.Namespace(filename=path, allow_host_access=True)) == 0
