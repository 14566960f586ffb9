"""Bad input never crashes the operator: random specs go through one `sync()` pass against the
scripted API; every outcome is either children applied or a Degraded condition with a message."""

from __future__ import annotations

import copy
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from operator_fake_api import FakeApiServer, run_sync  # noqa: E402

from tandem.operator.spec.service_spec import SpecError, parse_service  # noqa: E402

_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=True),
                  st.text(max_size=12), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5),
                                                                                             st.integers(), max_size=2))


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [prefix] + [p for k, v in node.items() for p in _paths(v, (*prefix, k))]
    return [prefix]


def _set(doc: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_specs_never_escape_sync(minimal_cr: dict[str, Any], data: Any) -> None:
    cr = copy.deepcopy(minimal_cr)
    paths = [p for p in _paths(cr["spec"]) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            _set(cr["spec"], path, data.draw(_LEAF))
        except (KeyError, TypeError):
            pass  # an earlier mutation replaced a parent
    result = run_sync(FakeApiServer(), cr)
    if result.error is not None:
        degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["message"]


@pytest.mark.parametrize("path, value, says", [
    (("prefill", "drainTimeoutSeconds"), "abc", "drainTimeoutSeconds"),
    (("decode", "replicas"), 10**8, "replicas must be an integer in 0..10000"),
    (("prefill", "tensorParallelSize"), 100_000, "tensorParallelSize"),
    (("router", "servicePort"), 70_000, "servicePort"),
    (("engine",), "not a mapping", "malformed"),
    # Flags the operator renders: a second copy would win, and the preStop drain or the Service
    # would then call a port nothing listens on.
    (("decode", "extraArgs"), ["--admin-port", "9001"], "extraArgs may not set --admin-port"),
    (("prefill", "extraArgs"), ["--bootstrap-port=1"], "extraArgs may not set --bootstrap-port"),
    (("router", "extraArgs"), ["--port", "1", "--policy", "round_robin"], "extraArgs may not set --port"),
])
def test_wrong_types_and_absurd_values_are_spec_errors(minimal_cr, path, value, says) -> None:
    cr = copy.deepcopy(minimal_cr)
    node = cr["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(SpecError, match=says):
        parse_service(cr)
    degraded = next(c for c in run_sync(FakeApiServer(), cr).status["conditions"] if c["type"] == "Degraded")
    assert says.split()[0] in degraded["message"]
