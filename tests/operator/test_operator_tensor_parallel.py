"""tensorParallelSize: GPUs per worker pod, the worker's tp_size, what a TP pod needs (shared memory,
requests per rank, a termination message), and the head-count check at reconcile."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_fake_api import FakeApiServer, run_sync
from operator_support import KUBE_VERSIONS, by_kind, kube_validate, render

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.spec.service_spec import SpecError, parse_service

GPU = "nvidia.com/gpu"


def tp_cr(minimal_cr: dict[str, Any], prefill: int, decode: int, heads: dict[str, int] | None = None) -> dict[str, Any]:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["prefill"] = {"tensorParallelSize": prefill}
    cr["spec"]["decode"] = {"tensorParallelSize": decode}
    if heads is not None:
        cr["spec"]["model"]["heads"] = heads
    return cr


def worker_pods(cr: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any], contract.EngineYaml]]:
    """role -> (Deployment, its worker container, the engine.yaml it mounts)."""
    kids = by_kind(render(cr))
    configmap = next(c for (kind, _), c in kids.items() if kind == "ConfigMap")
    out = {}
    for role in names.WORKER_ROLES:
        dep = kids[("Deployment", f"llama3-8b-{role}")]
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        out[role] = (dep, container, contract.EngineYaml.parse(configmap["data"][f"{role}.yaml"]))
    return out


@pytest.mark.parametrize(("prefill", "decode"), [(4, 4), (4, 2)])
def test_tp_sets_gpus_tp_size_and_what_a_tp_pod_needs(minimal_cr: dict[str, Any], prefill: int, decode: int) -> None:
    pods = worker_pods(tp_cr(minimal_cr, prefill, decode))
    for role, tp in ((names.PREFILL, prefill), (names.DECODE, decode)):
        dep, container, engine_yaml = pods[role]
        assert engine_yaml.tp_size == tp
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert limits[GPU] == tp  # one GPU per rank
        # One core and 4Gi per further rank on top of tp 1's 2 / 8Gi (requests only, no limits).
        assert requests == {"cpu": str(1 + tp), "memory": f"{4 + 4 * tp}Gi"}
        assert "cpu" not in limits and "memory" not in limits
        # NCCL and torch.distributed between the ranks need more than the runtime's 64 MiB /dev/shm.
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        # A start-up refusal (tp against the model's heads) reaches the pod's status.
        assert container["terminationMessagePath"] == contract.TERMINATION_MESSAGE_PATH
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[contract.ENV_TERMINATION_MESSAGE_PATH] == contract.TERMINATION_MESSAGE_PATH
        for version in KUBE_VERSIONS:
            kube_validate(dep, version)


def test_tp_one_keeps_the_old_requests(minimal_cr: dict[str, Any]) -> None:
    _, container, engine_yaml = worker_pods(minimal_cr)[names.DECODE]
    assert engine_yaml.tp_size == 1 and container["resources"]["limits"][GPU] == 1
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}


def test_user_resources_win_over_the_tp_defaults(minimal_cr: dict[str, Any]) -> None:
    cr = tp_cr(minimal_cr, 4, 4)
    cr["spec"]["decode"]["resources"] = {"requests": {"memory": "200Gi"}, "limits": {GPU: 8}}
    _, container, engine_yaml = worker_pods(cr)[names.DECODE]
    # Per key: the user's memory stays, the cpu the user left unset follows tp.
    assert container["resources"]["requests"] == {"memory": "200Gi", "cpu": "5"}
    assert container["resources"]["limits"] == {GPU: 8} and engine_yaml.tp_size == 4


def test_tp_changes_the_generation(minimal_cr: dict[str, Any]) -> None:
    """Ranks of different tp cannot exchange KV page by page: a new tp is a new generation."""
    def generation(cr: dict[str, Any]) -> str:
        dep, _, _ = worker_pods(cr)[names.PREFILL]
        return dep["metadata"]["labels"][names.LABEL_GENERATION]

    assert generation(tp_cr(minimal_cr, 4, 2)) != generation(tp_cr(minimal_cr, 2, 2))
    # The stated heads only inform the check; they change no pod.
    assert generation(tp_cr(minimal_cr, 4, 2, {"attention": 32, "keyValue": 8})) == generation(
        tp_cr(minimal_cr, 4, 2))


LLAMA_8B = {"attention": 32, "keyValue": 8}


@pytest.mark.parametrize(("prefill", "decode", "heads"), [
    (4, 2, LLAMA_8B), (8, 8, LLAMA_8B), (16, 1, LLAMA_8B),  # 8 KV heads replicated on 2 ranks each
    (4, 4, {"attention": 32}),  # no GQA
    (3, 1, None),  # heads unknown: nothing to check here; the worker checks at start
])
def test_tp_the_heads_allow_renders(minimal_cr: dict[str, Any], prefill: int, decode: int,
                                    heads: dict[str, int] | None) -> None:
    pods = worker_pods(tp_cr(minimal_cr, prefill, decode, heads))
    assert (pods[names.PREFILL][2].tp_size, pods[names.DECODE][2].tp_size) == (prefill, decode)


@pytest.mark.parametrize(("prefill", "decode", "heads", "says"), [
    (3, 1, LLAMA_8B, ["spec.prefill.tensorParallelSize 3", "32 attention heads"]),
    (1, 64, LLAMA_8B, ["spec.decode.tensorParallelSize 64", "32 attention heads"]),
    (4, 4, {"attention": 12, "keyValue": 6}, ["spec.prefill.tensorParallelSize 4", "spec.decode.tensorParallelSize 4",
                                              "6 KV heads"]),
    (2, 2, {"attention": 32, "keyValue": 6}, ["keyValue (6) must divide"]),
])
def test_tp_the_heads_refuse_is_an_invalid_spec_condition(minimal_cr: dict[str, Any], prefill: int, decode: int,
                                                          heads: dict[str, int], says: list[str]) -> None:
    cr = tp_cr(minimal_cr, prefill, decode, heads)
    with pytest.raises(SpecError) as err:
        parse_service(cr)
    assert all(any(s in p for p in err.value.problems) for s in says), err.value.problems
    server = FakeApiServer()
    result = run_sync(server, cr)
    conds = {c["type"]: c for c in result.status["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "InvalidSpec"
    assert conds["Ready"]["status"] == "False"
    assert all(s in conds["Degraded"]["message"] for s in says)
    assert not [p for p in server.objects if "/deployments/" in p]  # nothing is applied from it


@pytest.mark.parametrize("heads", [{"attention": 0}, {"attention": "32"}, {"keyValue": 8}, "32", {"attention": 10**6}])
def test_malformed_heads_are_spec_errors(minimal_cr: dict[str, Any], heads: Any) -> None:
    with pytest.raises(SpecError, match="spec.model.heads"):
        parse_service(tp_cr(minimal_cr, 1, 1, heads))


def test_expert_parallelism_rides_on_the_tp_ranks(minimal_cr: dict[str, Any]) -> None:
    """expertParallelSize = tensorParallelSize gives the worker ep_size; its GPUs stay tp."""
    cr = tp_cr(minimal_cr, 2, 4)
    cr["spec"]["decode"]["expertParallelSize"] = 4
    pods = worker_pods(cr)
    assert pods[names.DECODE][2].engine_args["ep_size"] == 4
    assert pods[names.DECODE][1]["resources"]["limits"][GPU] == 4
    assert "ep_size" not in pods[names.PREFILL][2].engine_args


def test_expert_parallelism_other_than_tp_is_refused(minimal_cr: dict[str, Any]) -> None:
    cr = tp_cr(minimal_cr, 2, 2)
    cr["spec"]["prefill"]["expertParallelSize"] = 4
    with pytest.raises(SpecError, match="expertParallelSize 4 must be 1 or tensorParallelSize 2"):
        parse_service(cr)


def test_an_fp8_kv_cache_on_gpu_workers_is_a_spec_error(minimal_cr: dict[str, Any]) -> None:
    """The engine refuses fp8 KV on a GPU at start-up in this release; the CR says so instead of
    crash-looping pods. With no GPU limit the operator would add TP GPUs, so that counts too."""
    cr = tp_cr(minimal_cr, 1, 1)
    cr["spec"].setdefault("engine", {})["kvCacheDtype"] = "fp8_e4m3"
    with pytest.raises(SpecError, match=r"kvCacheDtype fp8_e4m3 runs on CPU workers .*\(prefill, decode request GPUs"):
        parse_service(cr)
    for role in (names.PREFILL, names.DECODE):
        cr["spec"][role]["resources"] = {"limits": {GPU: 0}}
    assert parse_service(cr).engine_args["kv_cache_dtype"] == "fp8_e4m3"
