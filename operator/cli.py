"""`tandem operator render | run | crd`.

render and crd need neither kopf nor a cluster; run imports kopf only when called.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import yaml

from tandem.operator import names

if TYPE_CHECKING:
    from tandem.operator.security.operator_policy import OperatorPolicy


def register(sub: Any) -> None:
    parser = sub.add_parser("operator", help="The InferenceService operator.")
    commands = parser.add_subparsers(dest="operator_command", required=True)

    render = commands.add_parser("render", help="Print the children the operator would apply (YAML).")
    render.add_argument("-f", "--filename", required=True, help="InferenceService YAML ('-' for stdin).")
    render.add_argument("--allow-host-access", action="store_true",
                        help="render as an operator run with --allow-host-access would (hostPath models...)")
    render.set_defaults(func=render_command)

    _register_run(commands)
    crd = commands.add_parser("crd", help="Print the operator's CRDs (multi-document YAML).")
    crd.set_defaults(func=crd_command)


def _namespace(value: str) -> str:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", value):
        raise argparse.ArgumentTypeError(f"not a namespace name: {value!r}")
    return value


def _register_run(commands: Any) -> None:
    run = commands.add_parser("run", help="Run the operator (kopf).")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="Namespace to watch.")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="Watch every namespace.")
    run.add_argument("--interval", type=float, default=15.0, help="Seconds between autoscaler passes.")
    run.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--verbose", action="store_true")
    run.add_argument("--peering", metavar="NAME", default=None,
                     help="Join kopf peering NAME (leader election between replicas); standalone if absent.")
    run.add_argument("--priority", type=int, default=None,
                     help="Peering priority; the highest live replica acts. Default: older replicas rank "
                          "higher, all below 0.")
    run.add_argument("--metrics-port", type=int, default=8081,
                     help="Serve the operator's Prometheus metrics here; 0 disables.")
    run.add_argument("--allow-host-access", action="store_true",
                     help="Allow hostPath models and host/identity template overrides in InferenceServices.")
    run.add_argument("--http-from-namespace", metavar="NS", action="append", default=[], type=_namespace,
                     help="A namespace whose pods may reach the workers' HTTP port (repeatable); "
                          "the operator's own ($POD_NAMESPACE) is always allowed.")
    run.set_defaults(func=run_command)


def _load(filename: str) -> list[dict[str, Any]]:
    if filename == "-":
        return [d for d in yaml.safe_load_all(sys.stdin) if d]
    with open(filename, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def render_command(args: argparse.Namespace) -> int:
    from tandem.operator.reconcile import reconcile
    from tandem.operator.security.operator_policy import OperatorPolicy
    from tandem.operator.spec.service_spec import SpecError
    from tandem.operator.spec.unknown_fields import unknown_fields

    docs = [d for d in _load(args.filename) if d.get("kind") == names.KIND]
    if not docs:
        print(f"error: no {names.KIND} in {args.filename}", file=sys.stderr)
        return 2
    children: list[dict[str, Any]] = []
    for cr in docs:
        for field in unknown_fields(cr):  # an API server would prune these without a word; a typo shows here
            print(f"warning: {names.KIND} {cr.get('metadata', {}).get('name')!r}: unknown field {field}",
                  file=sys.stderr)
        try:
            children += reconcile(cr, OperatorPolicy(allow_host_access=args.allow_host_access))
        except SpecError as exc:
            print(f"error: {names.KIND} {cr.get('metadata', {}).get('name')!r}: {exc}", file=sys.stderr)
            return 1
    for cr in docs:  # not a child: the operator creates it once, with a random key (security/pd_secret.py)
        secret = names.pd_secret_name(str((cr.get("metadata") or {}).get("name")))
        print(f"# Prefill and decode pods read TANDEM_PD_SECRET from Secret {secret} (data key "
              f"'{names.PD_SECRET_KEY}'),\n# which the operator creates; applying this without the operator, create "
              "it first (a 40-character\n# Z85 key, e.g. python -c 'import os, zmq.utils.z85 as z; "
              "print(z.encode(os.urandom(32)).decode())').")
    yaml.safe_dump_all(children, sys.stdout, sort_keys=False)
    return 0


def policy_from(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> OperatorPolicy:
    """The OperatorPolicy the flags ask for; the operator's own namespace is always allowed
    to reach the workers' HTTP port, because the operator scrapes their metrics from there."""
    from tandem.operator.security.operator_policy import OperatorPolicy

    own = environ.get("POD_NAMESPACE", "")
    namespaces = dict.fromkeys([own, *args.http_from_namespace] if own else args.http_from_namespace)
    return OperatorPolicy(allow_host_access=args.allow_host_access, http_from_namespaces=tuple(namespaces))


def run_command(args: argparse.Namespace) -> int:
    from tandem.operator.handlers import OperatorConfig
    from tandem.operator.runner import run_operator

    namespaces = args.namespace or ([] if args.all_namespaces else ["default"])
    config = OperatorConfig(interval_s=args.interval, initial_delay_s=min(args.interval, 2.0),
                            policy=policy_from(args))
    return run_operator(namespaces, args.all_namespaces, config, liveness=args.liveness, verbose=args.verbose,
                        peering=args.peering, priority=args.priority, metrics_port=args.metrics_port)


def crd_command(args: argparse.Namespace) -> int:
    from tandem.operator.spec.crd import build_crds

    yaml.safe_dump_all(build_crds(), sys.stdout, sort_keys=False)
    return 0
