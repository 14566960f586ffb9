"""The operator's own metrics (operator/telemetry.py), the handlers' thin wrapping of sync(), and the
runner's peering arguments."""

from __future__ import annotations

import asyncio
import random
import socket
import urllib.request
from typing import Any

import kopf
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.operator import handlers, runner, telemetry
from tandem.operator.handlers import OperatorConfig
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.sync import SyncResult
from tandem.operator.telemetry import Telemetry


def degraded(reason: str) -> dict[str, Any]:
    return {"conditions": [{"type": "Degraded", "status": "True", "reason": reason, "message": "m"}]}


def value(t: Telemetry, name: str, **labels: str) -> float:
    found = t.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def run(t: Telemetry, handler: str, result: Any = None, raises: BaseException | None = None) -> None:
    with t.observe(handler, "ns", "svc") as outcome:
        if raises is not None:
            raise raises
        outcome.record(result)


@pytest.mark.parametrize("result, expected, kind", [
    (SyncResult({"url": "x"}), "ok", None),
    (SyncResult(degraded("InvalidSpec"), kopf.PermanentError("invalid spec")), "invalid", "invalid_spec"),
    (SyncResult(degraded("Forbidden"), kopf.PermanentError("refused")), "invalid", "forbidden"),
    (SyncResult(degraded("ApplyFailed"), kopf.PermanentError("422")), "error", "apply_failed"),
    (SyncResult(degraded("PDSecretInvalid"), kopf.PermanentError("bad key")), "error", "pd_secret_invalid"),
    (SyncResult({}, kopf.TemporaryError("409")), "error", "temporary"),
    (SyncResult(degraded("SomethingNew"), kopf.PermanentError("?")), "error", "unexpected"),
], ids=["ok", "invalid-spec", "forbidden", "apply-failed", "pd-secret-invalid", "temporary", "unknown-reason"])
def test_results_are_classified(result: SyncResult, expected: str, kind: str | None) -> None:
    t = Telemetry()
    run(t, "reconcile", result)
    assert value(t, "tandem_operator_reconcile_total", handler="reconcile", result=expected) == 1
    assert value(t, "tandem_operator_reconcile_duration_seconds_count", handler="reconcile") == 1
    errors = {k: value(t, "tandem_operator_errors_total", kind=k)
              for k in ("invalid_spec", "forbidden", "apply_failed", "pd_secret_invalid", "temporary", "unexpected")}
    assert errors == {k: (1.0 if k == kind else 0.0) for k in errors}


@pytest.mark.parametrize("exc, kind", [(kopf.TemporaryError("API down"), "temporary"),
                                       (RuntimeError("bug"), "unexpected")])
def test_exceptions_count_as_errors_and_propagate(exc: Exception, kind: str) -> None:
    t = Telemetry()
    with pytest.raises(type(exc)):
        run(t, "timer", raises=exc)
    assert value(t, "tandem_operator_reconcile_total", handler="timer", result="error") == 1
    assert value(t, "tandem_operator_errors_total", kind=kind) == 1


def test_cancellation_is_not_counted() -> None:
    t = Telemetry()
    with pytest.raises(asyncio.CancelledError):
        run(t, "timer", raises=asyncio.CancelledError())
    assert value(t, "tandem_operator_reconcile_duration_seconds_count", handler="timer") == 0


def test_services_gauge_follows_track_and_forget() -> None:
    t = Telemetry()
    for name in ("a", "b", "a"):
        run(t, "timer", SyncResult({}))  # same object each time: counted once
        t.track("ns", name)
    assert value(t, "tandem_operator_services") == 3  # ns/svc, ns/a, ns/b
    t.forget("ns", "a")
    t.forget("ns", "never-seen")
    assert value(t, "tandem_operator_services") == 2


def test_registries_are_private_and_served_on_a_port() -> None:
    a, b = Telemetry(), Telemetry()  # no duplicate-registration error: each has its own registry
    run(a, "reconcile", SyncResult({}))
    assert value(b, "tandem_operator_reconcile_total", handler="reconcile", result="ok") == 0
    b.serve(0)  # disabled: nothing to check but that it does not raise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a.serve(port, addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    # Only ours (no process_/python_ defaults); *_created are prometheus_client's creation stamps.
    assert {f.name.removesuffix("_created") for f in text_string_to_metric_families(text)} == {
        "tandem_operator_reconcile", "tandem_operator_reconcile_duration_seconds",
        "tandem_operator_errors", "tandem_operator_services"}


def test_of_memo_falls_back_to_a_private_instance() -> None:
    mine = Telemetry()
    assert telemetry.of({telemetry.MEMO_KEY: mine}) is mine
    assert isinstance(telemetry.of({}), Telemetry) and telemetry.of({}) is telemetry.of({})


class Patch:
    def __init__(self) -> None:
        self.status: dict[str, Any] = {}


def _call(handler: Any, memo: kopf.Memo) -> None:
    body = {"metadata": {"name": "svc", "namespace": "ns"}}
    asyncio.run(handler(spec={}, name="svc", namespace="ns", logger=None, body=body, memo=memo,
                        patch=Patch()))


def test_handlers_count_and_pass_the_policy_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    results = iter([SyncResult({"url": "u"}), SyncResult(degraded("InvalidSpec"), kopf.PermanentError("bad")),
                    SyncResult(degraded("InvalidSpec"), kopf.PermanentError("bad"))])

    async def fake_sync(cr: dict[str, Any], *args: Any, **kwargs: Any) -> SyncResult:
        seen.append(kwargs)
        return next(results)

    monkeypatch.setattr(handlers, "sync", fake_sync)
    policy = OperatorPolicy(allow_host_access=True, http_from_namespaces=("tandem-system",))
    t = Telemetry()
    memo = kopf.Memo(config=OperatorConfig(policy=policy), api=None, http=None)
    memo[telemetry.MEMO_KEY] = t
    _call(handlers.reconcile_handler, memo)
    with pytest.raises(kopf.PermanentError):
        _call(handlers.reconcile_handler, memo)
    _call(handlers.timer_handler, memo)  # a permanent problem is status only on the timer
    assert [k["policy"] for k in seen] == [policy] * 3
    assert [(k["autoscale"], k["prune_strays"]) for k in seen] == [(False, True), (False, True), (True, False)]
    assert value(t, "tandem_operator_reconcile_total", handler="reconcile", result="ok") == 1
    assert value(t, "tandem_operator_reconcile_total", handler="reconcile", result="invalid") == 1
    assert value(t, "tandem_operator_reconcile_total", handler="timer", result="invalid") == 1
    assert value(t, "tandem_operator_services") == 1
    asyncio.run(handlers.forget_handler(spec={}, name="svc", namespace="ns", logger=None, memo=memo))
    assert value(t, "tandem_operator_services") == 0


def test_default_priority_ranks_older_replicas_higher_and_below_zero() -> None:
    rng = random.Random(7)
    older, newer = runner.default_priority(1_750_000_000.000, rng), runner.default_priority(1_750_000_000.001, rng)
    assert older > newer and older < 0 and newer < 0
    same_ms = {runner.default_priority(1_750_000_000.0, rng) for _ in range(50)}
    assert len(same_ms) > 40 and max(same_ms) < older + runner.TIE_BREAK  # ties broken below the ms
    assert abs(runner.default_priority(4_000_000_000.0)) < 2**53  # exact in any JSON reader, to 2096


def test_peering_kwargs() -> None:
    assert runner.peering_kwargs(None, None) == {"standalone": True}
    assert runner.peering_kwargs("tandem", 5) == {"standalone": False, "peering_name": "tandem", "priority": 5}
    auto = runner.peering_kwargs("tandem", None)
    assert auto["peering_name"] == "tandem" and isinstance(auto["priority"], int) and auto["priority"] < 0


def test_unknown_fields_become_one_warning_event_per_reconcile(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []

    async def fake_sync(cr: dict[str, Any], *args: Any, **kwargs: Any) -> SyncResult:
        return SyncResult({"url": "u"}, warnings=("spec.prefill.replica (did you mean replicas?)",))

    monkeypatch.setattr(handlers, "sync", fake_sync)
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: events.append((reason, message)))
    memo = kopf.Memo(config=OperatorConfig(), api=None, http=None)
    memo[telemetry.MEMO_KEY] = Telemetry()
    _call(handlers.reconcile_handler, memo)
    _call(handlers.timer_handler, memo)  # the condition carries it on; no event per tick
    assert events == [("UnknownFields", "spec.prefill.replica (did you mean replicas?)")]
