"""Secrets in the rendered pods: the API key (spec.apiKeySecretRef) and the PD control key (a Secret the
operator creates once per InferenceService), always as env from a secretKeyRef, never on a command
line; the Z85 key encoding against pyzmq's."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from typing import Any

import httpx
import jsonschema
import kopf
import pytest
from operator_fake_api import FakeApiServer, run_sync
from operator_support import KUBE_VERSIONS, kube_validate

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.kubeapi import KubeApi
from tandem.operator.reconcile import reconcile
from tandem.operator.security import pd_secret
from tandem.operator.spec.crd import spec_schema
from tandem.operator.spec.service_spec import SpecError, parse_service
from tandem.pd.secret import check_pd_secret, new_pd_secret

KEY_REF = {"name": "llama-api", "key": "token"}
SECRET_PATH = f"/api/v1/namespaces/default/secrets/{names.pd_secret_name('llama3-8b')}"


@pytest.fixture
def keyed_cr(minimal_cr: dict[str, Any]) -> dict[str, Any]:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["apiKeySecretRef"] = dict(KEY_REF)
    return cr


# --- Z85 --------------------------------------------------------------------------------------------

def test_pd_secrets_are_curve_keys_pyzmq_takes() -> None:
    """The operator makes its keys with the workers' own function (tandem/pd/secret.py):
    40 Z85 characters that pyzmq decodes to 32 bytes, each new; malformed ones are refused."""
    zmq_z85 = pytest.importorskip("zmq.utils.z85")
    keys = {new_pd_secret() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        assert check_pd_secret(key) == key and len(zmq_z85.decode(key)) == 32
    for bad in ("#" * 40, "short", "0" * 39 + "~"):  # "#####" is past 2**32
        with pytest.raises(ValueError):
            check_pd_secret(bad)


# --- env, never argv ------------------------------------------------------------------------------

def _containers(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for d in children if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]}


def _secret_env(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    out = {}
    for e in container.get("env") or []:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            out[e["name"]] = (ref["name"], ref["key"])
    return out


def test_api_key_and_pd_key_reach_the_pods_as_secret_env(keyed_cr: dict[str, Any]) -> None:
    pods = _containers(reconcile(keyed_cr))
    pd = (names.pd_secret_name("llama3-8b"), names.PD_SECRET_KEY)
    api = (KEY_REF["name"], KEY_REF["key"])
    for role in (names.PREFILL, names.DECODE):
        assert _secret_env(pods[role]) == {contract.ENV_PD_SECRET: pd, contract.ENV_API_KEY: api}
    assert _secret_env(pods[names.ROUTER]) == {contract.ENV_API_KEY: api, contract.ENV_WORKER_API_KEY: api}
    assert contract.ENV_API_KEY == "TANDEM_API_KEY" and contract.ENV_WORKER_API_KEY == "TANDEM_WORKER_API_KEY"
    assert contract.ENV_PD_SECRET == "TANDEM_PD_SECRET"


def test_no_key_without_api_key_secret_ref(minimal_cr: dict[str, Any]) -> None:
    pods = _containers(reconcile(minimal_cr))
    assert set(_secret_env(pods[names.PREFILL])) == set(_secret_env(pods[names.DECODE])) == {contract.ENV_PD_SECRET}
    assert _secret_env(pods[names.ROUTER]) == {}


def test_no_secret_on_any_command_line(keyed_cr: dict[str, Any]) -> None:
    for name, c in _containers(reconcile(keyed_cr)).items():
        argv = " ".join([*c.get("command", []), *c.get("args", [])])
        assert "api-key" not in argv and "token" not in argv and "pd-secret" not in argv, name
        for e in c.get("env") or []:
            if e["name"] in (contract.ENV_API_KEY, contract.ENV_WORKER_API_KEY, contract.ENV_PD_SECRET):
                assert "value" not in e, (name, e)  # never a literal, only valueFrom


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_children_with_keys_are_valid_kubernetes(keyed_cr: dict[str, Any], version: str) -> None:
    for child in reconcile(keyed_cr):
        if child["apiVersion"] != names.API_VERSION:
            kube_validate(child, version)
    kube_validate(pd_secret.pd_secret(parse_service(keyed_cr), new_pd_secret()), version)


def test_schema_accepts_and_checks_api_key_secret_ref(keyed_cr: dict[str, Any]) -> None:
    jsonschema.Draft4Validator(spec_schema()).validate(keyed_cr)
    assert parse_service(keyed_cr).api_key is not None
    for bad in ({"name": "x"}, {"key": "k"}, {"name": "", "key": "k"}):
        cr = copy.deepcopy(keyed_cr)
        cr["spec"]["apiKeySecretRef"] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft4Validator(spec_schema()).validate(cr)
        with pytest.raises(SpecError, match="apiKeySecretRef"):
            parse_service(cr)


# --- the PD Secret: created once, kept, owned -------------------------------------------------------

def _key_of(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][names.PD_SECRET_KEY]).decode()


def test_sync_creates_the_pd_secret_once_and_keeps_it(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    assert run_sync(server, minimal_cr).error is None
    secret = server.objects[SECRET_PATH]
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == minimal_cr["metadata"]["uid"] and owner["controller"] is True
    key = _key_of(secret)
    assert len(key) == 40 and pd_secret.key_problem(secret) is None
    posts = [p for m, p in server.calls if m == "POST"]
    assert posts == ["/api/v1/namespaces/default/secrets"]
    for _ in range(2):
        run_sync(server, minimal_cr)
    assert _key_of(server.objects[SECRET_PATH]) == key
    assert [p for m, p in server.calls if m == "POST"] == posts  # never created (or rewritten) again


def test_an_existing_pd_secret_is_kept(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    mine = "0123456789" * 4
    server.objects[SECRET_PATH] = {"metadata": {"name": "x"}, "data": {
        names.PD_SECRET_KEY: base64.b64encode(mine.encode()).decode()}}
    assert run_sync(server, minimal_cr).error is None
    assert _key_of(server.objects[SECRET_PATH]) == mine
    assert not [p for m, p in server.calls if m == "POST"]


def test_a_broken_pd_secret_is_a_condition(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    server.objects[SECRET_PATH] = {"metadata": {"name": "x"}, "data": {names.PD_SECRET_KEY: "c2hvcnQ="}}
    result = run_sync(server, minimal_cr)
    assert isinstance(result.error, kopf.PermanentError)
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PDSecretInvalid" and "40-character Z85" in degraded["message"]
    assert not [p for m, p in server.calls if m == "PATCH" and "/deployments/" in p]  # no pod without a key


def test_a_create_race_reads_the_winners_key(minimal_cr: dict[str, Any]) -> None:
    """Another operator replica creates the Secret between our GET and POST: 409, and we keep theirs."""
    theirs = pd_secret.pd_secret(parse_service(minimal_cr), new_pd_secret())
    gets = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            gets.append(request.url.path)
            return (httpx.Response(404, json={"reason": "NotFound"}) if len(gets) == 1
                    else httpx.Response(200, json=theirs))
        assert request.method == "POST" and json.loads(request.content)["kind"] == "Secret"
        return httpx.Response(409, json={"reason": "AlreadyExists", "message": "exists"})

    async def go() -> str | None:
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(handler)) as client:
            return await pd_secret.ensure(KubeApi(client), parse_service(minimal_cr))

    assert asyncio.run(go()) is None and gets == [SECRET_PATH, SECRET_PATH]
