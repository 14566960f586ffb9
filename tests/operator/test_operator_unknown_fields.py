"""operator/spec/unknown_fields.py: undeclared spec fields are named (with a near match), free-form
subtrees are not, no input shape raises, and `tandem operator render` warns about them."""

from __future__ import annotations

import argparse
import copy
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_support import EXAMPLES_DIR, REPO

from tandem.operator.cli import render_command
from tandem.operator.spec import spec_schema
from tandem.operator.spec.unknown_fields import unknown_fields


@pytest.fixture
def cr() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES_DIR / "inferenceservice-minimal.yaml").read_text())


def test_a_valid_cr_has_no_unknown_fields(cr) -> None:
    assert unknown_fields(cr) == []


def test_typos_at_several_depths_are_named_with_a_suggestion(cr) -> None:
    spec = cr["spec"]
    spec["imagee"] = "x"
    spec.setdefault("prefill", {})["replica"] = 2
    spec["model"].setdefault("pvc", {"claimName": "m"})["claimname"] = "m"  # case only
    spec["autoscaling"] = {"scaleUp": {"cooldownSecond": 5}, "foo": 1}
    spec["kvTransfer"] = {"ucx": {"transport": ["rc"]}}
    spec["prefill"]["resources"] = {"limitz": {"cpu": 1}}  # resources is declared, not free-form
    assert unknown_fields(cr) == [
        "spec.model.pvc.claimname (did you mean claimName?)",  # in document order
        "spec.imagee (did you mean image?)",
        "spec.prefill.replica (did you mean replicas?)",
        "spec.prefill.resources.limitz (did you mean limits?)",
        "spec.autoscaling.scaleUp.cooldownSecond (did you mean cooldownSeconds?)",
        "spec.autoscaling.foo",  # nothing close: no suggestion
        "spec.kvTransfer.ucx.transport (did you mean transports?)",
    ]


def test_arrays_of_objects_are_walked(cr) -> None:
    cr["spec"]["imagePullSecrets"] = [{"name": "a"}, {"nam": "b"}]
    cr["spec"]["decode"] = {"tolerations": [{"key": "k", "operator": "Exists"}, {"key": "k", "efect": "NoSchedule"}]}
    assert unknown_fields(cr) == [
        "spec.imagePullSecrets[1].nam (did you mean name?)",
        "spec.decode.tolerations[1].efect (did you mean effect?)",
    ]


def test_free_form_subtrees_and_maps_are_not_reported(cr) -> None:
    spec = cr["spec"]
    spec["engine"] = {"pageSize": 16, "extra": {"anything_goes": {"deep": [1, {"x": 2}]}}}
    spec["prefill"] = {
        "template": {"metadata": {"annotations": {"a": "b"}}, "spec": {"priorityClassName": "p", "whatever": 1}},
        "resources": {"limits": {"nvidia.com/gpu": 1, "rdma/ib": 1}, "requests": {"cpu": "2"}},
        "nodeSelector": {"any.label/key": "v"},
        "extraArgs": ["--foo"],
    }
    assert unknown_fields(cr) == []


def test_only_spec_is_ours(cr) -> None:
    cr["metadata"]["annotations"] = {"x": "y"}
    cr["metadata"]["whatever"] = 1
    cr["status"] = {"nonsense": 1}
    cr["extraTopLevel"] = 1
    assert unknown_fields(cr) == []


@pytest.mark.parametrize("bad", [
    None, [], "x", 1, {"spec": None}, {"spec": []}, {"spec": "x"}, {"spec": {"prefill": [1, 2]}},
    {"spec": {"prefill": {"tolerations": {"key": "k"}}}}, {"spec": {"prefill": {"tolerations": [1, None, "x"]}}},
    {"spec": {"rollout": {"maxSurge": {"a": 1}}}},  # a map where int-or-string belongs: a type error, not ours
    {"spec": {1: 2, None: 3}}, {"spec": {"prefill": {"resources": {"limits": [1]}}}},
])
def test_junk_shapes_are_skipped(bad) -> None:
    assert all(p.startswith("spec.1") or p.startswith("spec.None") for p in unknown_fields(bad))


def test_a_self_referencing_value_does_not_recurse() -> None:
    loop: list[Any] = []
    loop.append(loop)
    nest: dict[str, Any] = {}
    nest["prefill"] = nest
    assert unknown_fields({"spec": {"prefill": {"tolerations": loop}}}) == []
    assert unknown_fields({"spec": nest}) == ["spec.prefill.prefill"]  # named once, not followed


def _names(node: Any) -> set[str]:
    """Every property name the schema declares, so generated junk reaches deep into it."""
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                out |= set(value)
            out |= _names(value)
    elif isinstance(node, list):
        for value in node:
            out |= _names(value)
    return out


KEYS = st.sampled_from(sorted(_names(spec_schema.ROOT_SCHEMA) | {"x", "replica", "", "spec"}))
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(KEYS | st.integers(), inner, max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JUNK)
def test_never_raises_on_any_shape(value) -> None:
    for cr in (value, {"spec": value}, {"kind": "InferenceService", "spec": {"prefill": value, "engine": value}}):
        found = unknown_fields(cr)
        assert isinstance(found, list) and all(isinstance(p, str) and p.startswith("spec.") for p in found)


# ---- every InferenceService written down in the repository is clean ----------------------------
def _yaml_texts(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return re.findall(r"```ya?ml\n(.*?)```", text, flags=re.S)
    if path.suffix == ".txt":  # the chart's NOTES: a heredoc with Helm expressions in it
        blocks = re.findall(r"<<YAML[^\n]*\n(.*?)\n\s*YAML\b", text, flags=re.S)
        return [re.sub(r"\{\{.*?\}\}", "0.1.0", textwrap.dedent(b)) for b in blocks]
    return [text]


def repo_crs() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for top in ("examples", "charts", "docs", "tests"):
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in (".yaml", ".yml", ".md", ".txt") or "kind: InferenceService" not in path.read_text(
                    encoding="utf-8", errors="replace"):
                continue
            for text in _yaml_texts(path):
                docs = list(yaml.safe_load_all(text))
                found += [(f"{path.relative_to(REPO)}:{d['metadata']['name']}", d) for d in docs
                          if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    return found


def test_every_inferenceservice_in_the_repo_has_no_unknown_fields() -> None:
    crs = repo_crs()
    assert len(crs) >= 5, [name for name, _ in crs]  # the four examples and the chart's NOTES
    assert {name: unknown_fields(cr) for name, cr in crs if unknown_fields(cr)} == {}


# ---- tandem operator render ----------------------------------------------------------------------
def test_render_warns_on_stderr_and_still_renders(cr, tmp_path, capsys) -> None:
    bad = copy.deepcopy(cr)
    bad["spec"].setdefault("prefill", {})["replica"] = 3
    bad["spec"]["autoscaling"] = {"foo": 1}
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(bad, sort_keys=False))
    assert render_command(argparse.Namespace(filename=str(path), allow_host_access=False)) == 0
    out, err = capsys.readouterr()
    name = cr["metadata"]["name"]
    assert err.splitlines() == [
        f"warning: InferenceService {name!r}: unknown field spec.prefill.replica (did you mean replicas?)",
        f"warning: InferenceService {name!r}: unknown field spec.autoscaling.foo",
    ]
    assert any(d["kind"] == "Deployment" for d in yaml.safe_load_all(out))


def test_render_is_quiet_for_a_clean_cr(cr, tmp_path, capsys) -> None:
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(cr))
    assert render_command(argparse.Namespace(filename=str(path), allow_host_access=False)) == 0
    assert capsys.readouterr().err == ""


def test_sync_reports_unknown_fields_as_a_condition_and_warnings(minimal_cr: dict[str, Any]) -> None:
    from test_operator_sync import FakeApiServer, run_sync

    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["prefill"] = {"replica": 3}
    result = run_sync(FakeApiServer(), cr)
    cond = next(c for c in result.status["conditions"] if c["type"] == "SpecWarnings")
    assert cond["status"] == "True" and "spec.prefill.replica (did you mean replicas?)" in cond["message"]
    assert result.warnings == ("spec.prefill.replica (did you mean replicas?)",)
    clean = run_sync(FakeApiServer(), minimal_cr)
    assert next(c for c in clean.status["conditions"] if c["type"] == "SpecWarnings")["status"] == "False"
