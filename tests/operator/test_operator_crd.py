"""The CRD: valid for Kubernetes, in sync with the chart, and its schema (jsonschema + CEL) accepts the
examples and rejects broken specs."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
import yaml
from operator_support import CHART_DIR, KUBE_VERSIONS, example_paths, kube_validate, load_example

from tandem.operator.spec.crd import SCALE_SUBRESOURCE, build_crd, build_crds, spec_schema
from tandem.operator.spec.schema_defaults import apply_defaults
from tandem.operator.spec.spec_schema import ROOT_SCHEMA

# The chart's templates/crds.yaml includes this file (tests/operator/test_operator_chart.py renders it).
CHART_CRDS = CHART_DIR / "files" / "crds.yaml"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_crd_is_a_valid_kubernetes_object(version: str) -> None:
    kube_validate(build_crd(), version)


def test_chart_crd_matches_operator_source() -> None:
    on_disk = [d for d in yaml.safe_load_all(CHART_CRDS.read_text()) if d]
    assert on_disk == build_crds(), f"regenerate with: tandem operator crd > {CHART_CRDS}"


def test_crd_declares_status_scale_and_printer_columns() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == SCALE_SUBRESOURCE
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Ready", "Prefill", "Decode", "Router", "Age"} <= columns
    # The scale paths must point at fields the schema actually has.
    props = ROOT_SCHEMA["properties"]
    assert props["spec"]["properties"]["decode"]["properties"]["replicas"]["type"] == "integer"
    assert "selector" in props["status"]["properties"]["decode"]["properties"]
    assert build_crd()["spec"]["names"]["shortNames"] == ["tisvc"]


def _validator() -> jsonschema.Draft4Validator:
    # The CRD schema is OpenAPI v3.0: boolean exclusiveMinimum, as in JSON Schema draft 4.
    schema = spec_schema()
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.stem)
def test_examples_validate_against_the_schema(path: Any) -> None:
    _validator().validate(yaml.safe_load(path.read_text()))


BROKEN: dict[str, tuple[str, Any]] = {
    "negative replicas": ("spec.decode.replicas", -1),
    "unknown policy": ("spec.engine.schedulePolicy", "shortest-first"),
    "mem fraction above 1": ("spec.engine.memFractionStatic", 1.5),
    "unknown kv backend": ("spec.kvTransfer.backend", "mooncake"),
    "unknown signal": ("spec.autoscaling.prefill.signal", "cpu"),
    "zero ratio": ("spec.autoscaling.ratio.min", 0),
    "tp too large": ("spec.prefill.tensorParallelSize", 128),
    "unknown tool parser": ("spec.model.toolCallParser", "pythonic"),
    "unknown reasoning parser": ("spec.model.reasoningParser", "o1"),
}


def _set(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    node = out
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_schema_rejects_broken_specs(case: str, minimal_cr: dict[str, Any]) -> None:
    dotted, value = BROKEN[case]
    with pytest.raises(jsonschema.ValidationError):
        _validator().validate(_set(minimal_cr, dotted, value))


def test_schema_requires_model_and_image(minimal_cr: dict[str, Any]) -> None:
    for field in ("model", "image"):
        broken = copy.deepcopy(minimal_cr)
        del broken["spec"][field]
        with pytest.raises(jsonschema.ValidationError):
            _validator().validate(broken)


def test_defaults_fill_roles_and_nested_sections(minimal_cr: dict[str, Any]) -> None:
    spec = apply_defaults(minimal_cr, ROOT_SCHEMA)["spec"]
    assert spec["decode"]["replicas"] == 1 and spec["decode"]["maxReplicas"] == 8
    assert spec["prefill"]["drainTimeoutSeconds"] == 120
    assert spec["router"]["serviceType"] == "ClusterIP"
    assert spec["kvTransfer"] == {"backend": "nixl", "ucx": {}, "portBase": 17000, "portCount": 64}
    assert spec["autoscaling"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert spec["autoscaling"]["decode"]["signal"] == "kvUtilization"
    assert spec["rollout"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "pageSize" not in spec["engine"]  # engine args default inside the engine, not here


# --- CEL (x-kubernetes-validations), evaluated with cel-python ------------------------------------

def _rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    found = [(path, r["rule"]) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in (schema.get("properties") or {}).items():
        found += _rules(sub, (*path, key))
    return found


def _cel_results(cr: dict[str, Any]) -> dict[str, bool]:
    celpy = pytest.importorskip("celpy", reason="pip install cel-python (operator-test)")
    env = celpy.Environment()
    obj = apply_defaults(cr, ROOT_SCHEMA)  # the API server defaults before it validates
    results = {}
    for path, rule in _rules(ROOT_SCHEMA):
        node: Any = obj
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue  # CEL rules run only on fields that are present
        program = env.program(env.compile(rule))
        results[f"{'.'.join(path)}: {rule}"] = bool(program.evaluate({"self": celpy.json_to_cel(node)}))
    return results


def test_cel_rules_exist_where_expected() -> None:
    paths = {".".join(p) for p, _ in _rules(ROOT_SCHEMA)}
    assert {"", "spec.model", "spec.prefill", "spec.decode", "spec.router",
            "spec.autoscaling.ratio", "spec.autoscaling.metricsSource"} <= paths


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.stem)
def test_cel_rules_accept_the_examples(path: Any) -> None:
    results = _cel_results(load_example(path))
    assert results and all(results.values()), [k for k, ok in results.items() if not ok]


CEL_BROKEN: dict[str, tuple[str, Any]] = {
    "two model sources": ("spec.model.hostPath", {"path": "/models"}),
    "min above max": ("spec.decode.minReplicas", 9),
    "inverted ratio": ("spec.autoscaling.ratio", {"min": 3.0, "max": 1.0}),
    "prometheus without url": ("spec.autoscaling.metricsSource", {"type": "prometheus"}),
    "long name": ("metadata.name", "x" * 41),
    "ep neither 1 nor tp": ("spec.decode.expertParallelSize", 2),  # tensorParallelSize defaults to 1
}


@pytest.mark.parametrize("case", sorted(CEL_BROKEN))
def test_cel_rules_reject_broken_specs(case: str, minimal_cr: dict[str, Any]) -> None:
    dotted, value = CEL_BROKEN[case]
    results = _cel_results(_set(minimal_cr, dotted, value))
    assert not all(results.values()), f"{case} passed every CEL rule"
