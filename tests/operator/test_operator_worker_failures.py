"""A worker that cannot start reaches the CR: its termination message (tandem/server/start_failure.py)
becomes the WorkersFailing condition (operator/worker_failures.py). Pod status is hostile input."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_fake_api import FakeApiServer, run_sync

from tandem.operator import names
from tandem.operator.spec.status_schema import STATUS_SCHEMA
from tandem.operator.worker_failures import (
    EXITED,
    MESSAGE_CHARS,
    REPORTED,
    RESTARTING,
    clean,
    worker_failures,
    workers_failing,
)

TP_ERROR = ("start-up failed: RuntimeError: scheduler ready-0 failed to start: ValueError: tp_size 3 does not "
            "divide the model's 32 attention heads")


def pod(name: str, role: str, *statuses: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": names.selector_labels("llama3-8b", role)},
            "status": {"containerStatuses": list(statuses)}}


def crash_looping(role: str, message: str = TP_ERROR, restarts: int = 4) -> dict[str, Any]:
    return {"name": role, "ready": False, "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}


def test_a_crash_loop_carries_the_workers_own_error() -> None:
    (failure,) = worker_failures([pod("p-decode-1", "decode", crash_looping("decode"))])
    assert (failure.reason, failure.restarts, failure.exit_code, failure.exit_reason) == (
        "CrashLoopBackOff", 4, 1, "Error")
    assert failure.message == TP_ERROR
    cond = workers_failing((failure,))
    assert (cond.status, cond.reason) == ("True", "CrashLoopBackOff")
    assert cond.message == f"pod p-decode-1 (decode): CrashLoopBackOff, 4 restarts, exit code 1 (Error): {TP_ERROR}"


def test_the_moments_around_a_crash_count_too() -> None:
    just_exited = {"name": "prefill", "restartCount": 0,
                   "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": TP_ERROR}}}
    # Running again after a failed run, not ready yet: still failing, so the condition does not
    # flip to False and back on every restart of a crash loop.
    retrying = {"name": "prefill", "ready": False, "restartCount": 2, "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    found = worker_failures([pod("a", "prefill", just_exited), pod("b", "prefill", retrying)])
    assert [(f.pod, f.reason, f.exit_code) for f in found] == [("a", EXITED, 1), ("b", RESTARTING, 137)]
    assert "exit code 137 (OOMKilled)" in found[1].describe()


@pytest.mark.parametrize("status", [
    {"name": "decode", "ready": True, "restartCount": 3, "state": {"running": {}},
     "lastState": {"terminated": {"exitCode": 1}}},  # came back: not failing any more
    {"name": "decode", "ready": False, "restartCount": 0, "state": {"running": {}}},  # loading the model
    {"name": "decode", "ready": False, "restartCount": 1, "state": {"running": {}},
     "lastState": {"terminated": {"exitCode": 0}}},  # drained and restarted
    {"name": "decode", "state": {"waiting": {"reason": "ContainerCreating"}}},
    {"name": "istio-proxy", **{k: v for k, v in crash_looping("decode").items() if k != "name"}},  # a sidecar's
])
def test_healthy_or_not_the_worker_is_not_failing(status: dict[str, Any]) -> None:
    assert worker_failures([pod("p", "decode", status)]) == ()


def test_router_pods_are_not_workers() -> None:
    assert worker_failures([pod("r", "router", crash_looping("router"))]) == ()


def test_image_pull_failures_use_the_waiting_message() -> None:
    pulling = {"name": "prefill", "restartCount": 0,
               "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'}}}
    (failure,) = worker_failures([pod("p", "prefill", pulling)])
    assert failure.reason == "ImagePullBackOff" and failure.message == 'Back-off pulling image "x:1"'
    assert failure.exit_code is None and "exit code" not in failure.describe()


def test_messages_first_then_a_bounded_list() -> None:
    pods = [pod(f"p-{i}", "decode", crash_looping("decode", message="" if i % 2 else TP_ERROR)) for i in range(9)]
    found = worker_failures(pods)
    assert [f.pod for f in found] == ["p-0", "p-2", "p-4", "p-6", "p-8", "p-1", "p-3", "p-5", "p-7"]
    cond = workers_failing(found)
    assert cond.message.count("pod p-") == REPORTED and cond.message.endswith("and 6 more failing worker containers")


def test_hostile_messages_are_printable_one_line_and_clipped() -> None:
    hostile = "\x1b[2J\u202eevil\x00" + "Traceback:\n" + "x" * 100_000 + "\nValueError: the real reason\r\n"
    (failure,) = worker_failures([pod("p\n\x07", "decode", crash_looping("decode", message=hostile))])
    assert len(failure.message) <= MESSAGE_CHARS and failure.message.isprintable()
    assert failure.message.startswith("[2J evil") and failure.message.endswith("ValueError: the real reason")
    assert failure.pod == "p"
    assert clean(None, 10) == "" and clean("a\nb", 10) == "a | b"


def test_a_kubelet_reason_is_kept_only_as_a_short_word() -> None:
    status = crash_looping("decode")
    status["lastState"]["terminated"]["reason"] = "Error; rm -rf / " * 10
    (failure,) = worker_failures([pod("p", "decode", status)])
    assert failure.exit_reason == "" and failure.reason == "CrashLoopBackOff"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30)
CONTAINER = st.fixed_dictionaries({"name": st.sampled_from(["decode", "prefill", 7])}, optional={
    "ready": JSON, "restartCount": JSON, "state": JSON, "lastState": JSON,
    "_state": st.fixed_dictionaries({"waiting": st.fixed_dictionaries({"reason": st.sampled_from(
        ["CrashLoopBackOff", "ImagePullBackOff", 3]), "message": JSON})})})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(statuses=st.lists(CONTAINER, max_size=4), raw=JSON, role=st.sampled_from(["decode", "prefill", "router", 1]))
def test_any_pod_status_gives_a_bounded_condition(statuses: list[dict[str, Any]], raw: Any, role: Any) -> None:
    for s in statuses:
        if "_state" in s:
            s["state"] = s.pop("_state")
    pods: list[Any] = [{"metadata": {"name": "p", "labels": {names.LABEL_COMPONENT: role}},
                        "status": {"containerStatuses": statuses}}, raw, {"metadata": raw, "status": raw}]
    cond = workers_failing(worker_failures(pods))
    assert len(cond.message) <= REPORTED * (MESSAGE_CHARS + 300) + 100 and cond.message.isprintable()


def _workers_failing(result: Any) -> dict[str, Any]:
    return next(c for c in result.status["conditions"] if c["type"] == "WorkersFailing")


def test_sync_reports_the_workers_error_and_clears_it(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    first = run_sync(server, minimal_cr)
    assert _workers_failing(first)["status"] == "False"
    path = "/api/v1/namespaces/default/pods/llama3-8b-decode-x-1"
    server.objects[path] = pod("llama3-8b-decode-x-1", "decode", crash_looping("decode"))
    cr = copy.deepcopy(minimal_cr)
    cr["status"] = first.status
    result = run_sync(server, cr)
    jsonschema.Draft4Validator(STATUS_SCHEMA).validate(result.status)
    failing = _workers_failing(result)
    assert failing["status"] == "True" and failing["reason"] == "CrashLoopBackOff"
    assert "llama3-8b-decode-x-1 (decode)" in failing["message"] and TP_ERROR in failing["message"]
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PodsFailing"
    # The pod comes up (a corrected spec, a fixed volume): the condition clears.
    server.objects[path]["status"]["containerStatuses"] = [
        {"name": "decode", "ready": True, "restartCount": 5, "state": {"running": {}},
         "lastState": {"terminated": {"exitCode": 1, "message": TP_ERROR}}}]
    cr["status"] = result.status
    assert _workers_failing(run_sync(server, cr))["status"] == "False"
