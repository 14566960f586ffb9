"""`tandem operator render | run | crd`.

render and crd need neither kopf nor a cluster; run imports kopf only when called.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from tandem.operator import names


def register(sub: Any) -> None:
    parser = sub.add_parser("operator", help="The InferenceService operator.")
    commands = parser.add_subparsers(dest="operator_command", required=True)

    render = commands.add_parser("render", help="Print the children the operator would apply (YAML).")
    render.add_argument("-f", "--filename", required=True, help="InferenceService YAML ('-' for stdin).")
    render.set_defaults(func=render_command)

    run = commands.add_parser("run", help="Run the operator (kopf).")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="Namespace to watch.")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="Watch every namespace.")
    run.add_argument("--interval", type=float, default=15.0, help="Seconds between autoscaler passes.")
    run.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--verbose", action="store_true")
    run.set_defaults(func=run_command)

    crd = commands.add_parser("crd", help="Print the InferenceService CRD.")
    crd.set_defaults(func=crd_command)


def _load(filename: str) -> list[dict[str, Any]]:
    if filename == "-":
        return [d for d in yaml.safe_load_all(sys.stdin) if d]
    with open(filename, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def render_command(args: argparse.Namespace) -> int:
    from tandem.operator.reconcile import reconcile
    from tandem.operator.spec import SpecError

    docs = [d for d in _load(args.filename) if d.get("kind") == names.KIND]
    if not docs:
        print(f"error: no {names.KIND} in {args.filename}", file=sys.stderr)
        return 2
    children: list[dict[str, Any]] = []
    for cr in docs:
        try:
            children += reconcile(cr)
        except SpecError as exc:
            print(f"error: {names.KIND} {cr.get('metadata', {}).get('name')!r}: {exc}", file=sys.stderr)
            return 1
    yaml.safe_dump_all(children, sys.stdout, sort_keys=False)
    return 0


def run_command(args: argparse.Namespace) -> int:
    from tandem.operator.handlers import OperatorConfig
    from tandem.operator.runner import run_operator

    namespaces = args.namespace or ([] if args.all_namespaces else ["default"])
    config = OperatorConfig(interval_s=args.interval, initial_delay_s=min(args.interval, 2.0))
    return run_operator(namespaces, args.all_namespaces, config, liveness=args.liveness, verbose=args.verbose)


def crd_command(args: argparse.Namespace) -> int:
    from tandem.operator.crd import build_crd

    yaml.safe_dump(build_crd(), sys.stdout, sort_keys=False)
    return 0
