"""Helpers shared by the operator tests: paths, example CRs, offline Kubernetes schema
validation. tests/support is on sys.path through pytest's `pythonpath`."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repo root
EXAMPLES_DIR = REPO / "examples"
CHART_DIR = REPO / "charts" / "tandem"
KUBE_VERSIONS = ("1.30", "1.33")


def example_paths() -> list[Path]:
    return sorted(EXAMPLES_DIR.glob("inferenceservice-*.yaml"))


def load_example(path: Path, uid: str = "5b0cde52-35a0-4b4e-9a39-5d8f2f5e3c11") -> dict[str, Any]:
    cr = yaml.safe_load(path.read_text())
    cr["metadata"].setdefault("uid", uid)
    cr["metadata"].setdefault("generation", 1)
    return cr


@functools.lru_cache(maxsize=1)
def _kv() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


def kube_validate(manifest: dict[str, Any], version: str) -> None:
    """Validate one manifest against the real Kubernetes schema, strict (no unknown fields)."""
    kv = _kv()
    try:
        kv.validate(copy.deepcopy(manifest), version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        name = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
        raise AssertionError(f"{name} invalid for Kubernetes {version} at {path}: {exc.message}") from None


def render(cr: dict[str, Any]) -> list[dict[str, Any]]:
    """reconcile() under a policy that allows host access, so every example renders (the
    cpu-hostpath one mounts a hostPath); the policy itself is tested on its own."""
    from tandem.operator.reconcile import reconcile
    from tandem.operator.security.operator_policy import OperatorPolicy

    return reconcile(cr, OperatorPolicy(allow_host_access=True))


def short_name(child: dict[str, Any]) -> str:
    """A child's name without its model-generation suffix (Deployments and the engine ConfigMap
    carry one), so tests can say `llama3-8b-prefill` whatever the generation hash is."""
    from tandem.operator import names

    meta = child["metadata"]
    gen = (meta.get("labels") or {}).get(names.LABEL_GENERATION)
    if gen and child["kind"] in ("Deployment", "ConfigMap") and meta["name"].endswith(f"-{gen}"):
        return meta["name"][: -len(gen) - 1]
    return meta["name"]


def by_kind(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], short_name(c)): c for c in children}


def container(child: dict[str, Any]) -> dict[str, Any]:
    """The first container of a Deployment (or any pod-template child)."""
    return child["spec"]["template"]["spec"]["containers"][0]


def render_chart(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every document the chart renders with these values (release tandem, namespace tandem-system)."""
    files = chart.render(values, name="tandem", namespace="tandem-system")
    return [d for path, text in sorted(files.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def merge_patch(base: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386), as the API server applies the operator's merge_patch."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
