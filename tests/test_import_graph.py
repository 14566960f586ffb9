"""The import graph, read from the source with `ast`: every `import` counts, function-local
ones included, so a cycle cannot hide behind an import placed inside a function.

- Packages form no cycle: the engine's sub-packages layer (scheduler above runner above
  models above attention; kvcache below the scheduler), and so do the operator's (spec at
  the bottom; render, security, scaling, rollout above it).
- Modules form no cycle at run time; inside the engine, none even through the imports under
  `if TYPE_CHECKING:` (hints are part of the design: a part typed against the scheduler that
  drives it is a circle). Elsewhere hints may close a loop.
- Only engine/scheduler/ names the concrete `Scheduler`: a role part, the admin commands and
  the fault handling get the narrow host (engine/scheduler/role_part.py), never the class.
- The engine imports nothing from the PD roles, the servers or Kubernetes; the router, the
  protocol package and the operator reach no module that imports torch.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edge:
    target: str  # a tandem module
    type_only: bool  # under `if TYPE_CHECKING:`


@cache
def modules() -> dict[str, Path]:
    """Every tandem module by dotted name, from pyproject's package-dir mapping."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for pkg, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [*pkg.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), path)  # tandem/engine is a link to engine/
    return found


def _names(node: ast.AST, module: str, is_pkg: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        yield target
        yield from (f"{target}.{a.name}" for a in node.names)  # `from pkg import module`


def _type_only_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    return lines


@cache
def edges(module: str) -> frozenset[Edge]:
    path = modules()[module]
    tree = ast.parse(path.read_text())
    type_only = _type_only_lines(tree)
    out = set()
    for node in ast.walk(tree):
        for name in _names(node, module, path.name == "__init__.py"):
            while name not in modules() and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules() and name != module and not module.startswith(name + "."):
                out.add(Edge(name, node.lineno in type_only))
    return frozenset(out)


@cache
def imports_torch(module: str) -> bool:
    tree = ast.parse(modules()[module].read_text())
    return any(n.split(".")[0] == "torch" for node in ast.walk(tree) for n in _names(node, module, False))


def package(module: str) -> str:
    return module if modules()[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_packages_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for module in modules():
        src = package(module)
        for edge in edges(module):
            dst = package(edge.target)
            # a package importing its own parent is the parent's business: modules checked below
            if dst != src and not src.startswith(dst + "."):
                graph.setdefault(src, set()).add(dst)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_modules_form_no_cycle_at_run_time() -> None:
    graph = {m: {e.target for e in edges(m) if not e.type_only} for m in modules()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_engine_has_no_cycle_even_through_type_hints() -> None:
    engine = [m for m in modules() if m.startswith("tandem.engine")]
    graph = {m: {e.target for e in edges(m) if e.target.startswith("tandem.engine")} for m in engine}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_only_the_scheduler_package_names_the_concrete_scheduler() -> None:
    concrete = "tandem.engine.scheduler.scheduler"
    bad = sorted(m for m in modules() if not m.startswith("tandem.engine.scheduler.")
                 and any(e.target == concrete for e in edges(m)))
    assert not bad


def reachable(start: str) -> set[str]:
    seen, todo = set(), [m for m in modules() if m == start or m.startswith(start + ".")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(e.target for e in edges(module) if not e.type_only)
    return seen


def test_the_engine_imports_no_role_server_or_kubernetes_code() -> None:
    outside = ("tandem.prefill", "tandem.decode", "tandem.pd", "tandem.server", "tandem.router",
               "tandem.operator", "tandem.web", "tandem.local")
    bad = sorted(m for m in reachable("tandem.engine") if m.startswith(outside))
    assert not bad


@pytest.mark.parametrize("start", ["tandem.router", "tandem.protocol", "tandem.pd.protocol",
                                   "tandem.pd.secret", "tandem.operator", "tandem.web"])
def test_torch_free_parts_reach_no_torch_import(start: str) -> None:
    assert not sorted(m for m in reachable(start) if imports_torch(m))
