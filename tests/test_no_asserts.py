"""No `assert` on state a client or a peer can reach, in any code that serves: an assert that
fires ends the thread it runs on (the scheduler's, the control channel's, an event loop's
task) and with it every request there, and `python -O` removes it silently. Reachable state is
checked explicitly and fails the one request, frame or peer it came from.

Two kinds of assert remain, and each says which it is:
- inside a `check_integrity*` function: the idle pool check's own reporting (a failure is a
  bug in this process, found when nothing runs; tests call it after each case);
- on a line marked `# invariant: <why>` (or below one): a fact this process's own code guarantees, which no
  input can break (the why names what guarantees it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every package a serving process runs: the engine (less the offline model tools), the roles,
# the router and the shared serving code.
SERVING = ["engine", "prefill", "decode", "router", "tandem/server", "tandem/web", "tandem/protocol", "tandem/pd"]
NOT_SERVING = {ROOT / "engine" / "modelgen", ROOT / "engine" / "kernels"}


def _asserts(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, enclosing function) of every assert."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            if isinstance(child, ast.Assert):
                found.append((child.lineno, func))
            visit(child, name)

    visit(tree, "")
    return found


def test_no_assert_on_reachable_state_in_serving_code() -> None:
    offenders = []
    for top in SERVING:
        for path in sorted((ROOT / top).rglob("*.py")):
            if any(path.is_relative_to(p) for p in NOT_SERVING):
                continue
            source = path.read_text()
            lines = source.splitlines()
            for n, func in _asserts(ast.parse(source)):
                marked = "# invariant:" in lines[n - 1] or "# invariant:" in lines[n - 2]
                if marked or func.startswith("check_integrity") or func == "check_invariants":
                    continue
                offenders.append(f"{path.relative_to(ROOT)}:{n} (in {func or 'module'}): {lines[n - 1].strip()}")
    assert not offenders, ("check reachable state explicitly and fail only its request; mark a true "
                           "invariant `# invariant: <why>`:\n" + "\n".join(offenders))
