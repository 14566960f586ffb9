"""No test waits for a condition by sleeping: a sleep "long enough" fails on a loaded machine
and wastes time on an idle one. Tests wait on state (tests/support/waits.py polls a condition
against a deadline). A sleep that measures or simulates time on purpose (a slow fake peer, a
heartbeat window that must pass quietly) says so on its line with `# sleep-ok: <why>`."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ALLOWED_FILES = {TESTS / "support" / "waits.py"}


def _sleep_calls(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "sleep":
                lines.append(node.lineno)
    return lines


def test_no_test_sleeps_without_saying_why() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path in ALLOWED_FILES:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for n in _sleep_calls(ast.parse(source)):
            if "# sleep-ok:" not in lines[n - 1]:
                offenders.append(f"{path.relative_to(TESTS)}:{n}: {lines[n - 1].strip()}")
    assert not offenders, "wait on state (tests/support/waits.py) instead:\n" + "\n".join(offenders)
