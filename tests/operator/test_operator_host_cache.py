"""`hostCacheGiB` per worker role: the pod's KV host tier (docs/engine.md, "Host tier"). The
role's engine.yaml turns the tier on with each TP rank's share, the pod's memory request (and
limit, where the user set one) grows by the tier, and a bad value is a spec error."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.utils import parse_quantity
from test_operator_tensor_parallel import tp_cr, worker_pods

from tandem.operator import names
from tandem.operator.spec.service_spec import SpecError, parse_service
from tandem.operator.spec.spec_schema import ROOT_SCHEMA as crd_root

GIB = 2**30


def test_the_tier_is_each_ranks_share_and_the_pod_asks_for_its_memory(minimal_cr: dict[str, Any]) -> None:
    cr = tp_cr(minimal_cr, 1, 2)
    cr["spec"]["decode"]["hostCacheGiB"] = 16
    cr["spec"]["decode"]["resources"] = {"limits": {"memory": "64Gi"}}
    pods = worker_pods(cr)
    _, container, engine = pods[names.DECODE]
    assert engine.engine_args["enable_hierarchical_cache"] is True and engine.engine_args["hicache_size"] == 8.0
    assert parse_quantity(container["resources"]["limits"]["memory"]) == 80 * GIB
    _, plain, prefill_engine = pods[names.PREFILL]  # the other role is untouched
    assert "enable_hierarchical_cache" not in prefill_engine.engine_args
    assert parse_quantity(plain["resources"]["requests"]["memory"]) == 8 * GIB  # the default request


def test_a_default_request_grows_by_the_tier(minimal_cr: dict[str, Any]) -> None:
    cr = tp_cr(minimal_cr, 1, 1)
    cr["spec"]["prefill"]["hostCacheGiB"] = 2.5
    _, container, engine = worker_pods(cr)[names.PREFILL]
    assert parse_quantity(container["resources"]["requests"]["memory"]) == int(10.5 * GIB)
    assert engine.engine_args["hicache_size"] == 2.5


@pytest.mark.parametrize("bad", [-1, 5000, "16Gi", True])
def test_a_bad_size_is_a_spec_error(minimal_cr: dict[str, Any], bad: Any) -> None:
    cr = tp_cr(minimal_cr, 1, 1)
    cr["spec"]["decode"]["hostCacheGiB"] = bad
    with pytest.raises(SpecError, match="spec.decode.hostCacheGiB must be a number of GiB in 0..4096"):
        parse_service(cr)


def test_the_crd_schema_bounds_it() -> None:
    props = crd_root["properties"]["spec"]["properties"]
    for role in names.WORKER_ROLES:
        assert props[role]["properties"]["hostCacheGiB"] | {"description": ""} == {
            "type": "number", "minimum": 0, "maximum": 4096, "default": 0, "description": ""}
    assert "hostCacheGiB" not in props[names.ROUTER]["properties"]
