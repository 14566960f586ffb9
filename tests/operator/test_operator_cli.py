"""`tandem operator render|crd|run` wiring, and the rule that the operator never imports torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest
import yaml
from operator_support import EXAMPLES_DIR, REPO, load_example

from tandem.operator.cli import policy_from, register
from tandem.operator.reconcile import reconcile
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.spec.crd import build_crds


def run_module(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.operator", *args], capture_output=True, text=True,
                          input=stdin, cwd=REPO, timeout=60)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem")
    register(p.add_subparsers(dest="command", required=True))
    return p


def test_register_wires_render_run_and_crd() -> None:
    p = parser()
    render = p.parse_args(["operator", "render", "-f", "cr.yaml"])
    run = p.parse_args(["operator", "run", "-n", "a", "-n", "b", "--interval", "5"])
    assert render.func.__name__ == "render_command" and render.filename == "cr.yaml"
    assert run.func.__name__ == "run_command" and run.namespace == ["a", "b"] and run.interval == 5.0
    assert p.parse_args(["operator", "crd"]).func.__name__ == "crd_command"
    with pytest.raises(SystemExit):
        p.parse_args(["operator", "run", "-n", "a", "-A"])


def test_run_flags_and_their_defaults() -> None:
    p = parser()
    default = p.parse_args(["operator", "run", "-A"])
    assert (default.peering, default.priority, default.metrics_port) == (None, None, 8081)
    assert default.allow_host_access is False and default.http_from_namespace == []
    args = p.parse_args(["operator", "run", "-A", "--peering", "tandem", "--priority", "-5",
                         "--metrics-port", "0", "--allow-host-access",
                         "--http-from-namespace", "monitoring", "--http-from-namespace", "ops"])
    assert (args.peering, args.priority, args.metrics_port) == ("tandem", -5, 0)
    assert args.allow_host_access is True and args.http_from_namespace == ["monitoring", "ops"]
    with pytest.raises(SystemExit):
        p.parse_args(["operator", "run", "--http-from-namespace", "Not_A_Namespace"])


def test_policy_always_admits_the_operators_own_namespace() -> None:
    args = parser().parse_args(["operator", "run", "--http-from-namespace", "monitoring",
                                "--http-from-namespace", "tandem-system"])
    assert policy_from(args, {"POD_NAMESPACE": "tandem-system"}) == OperatorPolicy(
        allow_host_access=False, http_from_namespaces=("tandem-system", "monitoring"))
    assert policy_from(args, {}).http_from_namespaces == ("monitoring", "tandem-system")
    bare = parser().parse_args(["operator", "run", "--allow-host-access"])
    assert policy_from(bare, {}) == OperatorPolicy(allow_host_access=True)


def test_tandem_console_parser_includes_the_operator() -> None:
    from tandem.cli import build_parser

    args = build_parser(("tandem.operator.cli",)).parse_args(["operator", "render", "-f", "x.yaml"])
    assert args.func.__name__ == "render_command"


def test_render_prints_what_reconcile_applies() -> None:
    path = EXAMPLES_DIR / "inferenceservice-autoscaling.yaml"
    result = run_module("render", "-f", str(path))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    cr = yaml.safe_load(path.read_text())
    assert docs == reconcile(cr)
    assert [d["kind"] for d in docs].count("Deployment") == 3


def test_render_reads_stdin_and_rejects_invalid_specs() -> None:
    cr: dict[str, Any] = load_example(EXAMPLES_DIR / "inferenceservice-minimal.yaml")
    cr["spec"]["model"] = {"servedName": "m", "uri": "s3://bucket/m"}
    result = run_module("render", "-f", "-", stdin=yaml.safe_dump(cr))
    assert result.returncode == 1 and "reserved" in result.stderr and result.stdout == ""
    assert run_module("render", "-f", "-", stdin="kind: ConfigMap\n").returncode == 2


def test_crd_command_prints_every_crd() -> None:
    result = run_module("crd")
    assert result.returncode == 0 and list(yaml.safe_load_all(result.stdout)) == build_crds()
    assert [c["spec"]["names"]["kind"] for c in build_crds()] == ["InferenceService", "RoleScaler"]


def test_operator_never_imports_torch() -> None:
    code = (
        "import pkgutil, importlib, sys, tandem.operator as op\n"
        "import tandem.metric_names\n"
        "mods = [m.name for m in pkgutil.walk_packages(op.__path__, 'tandem.operator.')]\n"
        "[importlib.import_module(m) for m in mods]\n"
        "heavy = sorted(n for n in ('torch', 'transformers', 'numpy') if n in sys.modules)\n"
        "print(len(mods), heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count, heavy = result.stdout.split(" ", 1)
    assert int(count) > 15 and heavy.strip() == "[]"
