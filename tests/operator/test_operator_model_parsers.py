"""spec.model.toolCallParser / reasoningParser: how the workers parse chat answers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_support import by_kind, container, render

from tandem.operator.spec.service_spec import SpecError


def test_the_models_parsers_reach_every_workers_command_line(minimal_cr: dict[str, Any]) -> None:
    """spec.model.toolCallParser / reasoningParser: the worker fronts parse chat answers (also in
    PD, where the decode worker streams them), so each worker role gets the flags."""
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["model"].update(toolCallParser="hermes", reasoningParser="qwen3")
    kids = by_kind(render(cr))
    for role in ("prefill", "decode"):
        command = container(kids[("Deployment", f"llama3-8b-{role}")])["command"]
        assert command[command.index("--tool-call-parser") + 1] == "hermes"
        assert command[command.index("--reasoning-parser") + 1] == "qwen3"
    plain = container(by_kind(render(minimal_cr))[("Deployment", "llama3-8b-decode")])["command"]
    assert "--tool-call-parser" not in plain and "--reasoning-parser" not in plain


# The schema's enum stops these at the API server; reconcile refuses them too (an older CRD,
# a dry run, `tandem operator render`).
@pytest.mark.parametrize("field, value", [("toolCallParser", "x"), ("reasoningParser", 7)])
def test_unknown_parsers_are_spec_errors(minimal_cr: dict[str, Any], field: str, value: Any) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["model"] = {"servedName": "m", "hostPath": {"path": "/m"}, field: value}
    with pytest.raises(SpecError, match=f"spec.model.{field} must be one of"):
        render(cr)
