"""The operator's pods start `tandem serve` exactly as rendered: the argv, env and engine
YAML of a reconciled InferenceService, with only the model mount and the config path
pointed at local files and the port moved to a free one."""

from __future__ import annotations

from pathlib import Path

import pytest
from operator_support import by_kind, example_paths, load_example, render
from pd_client import pd_post
from worker_process import Worker, free_port

from tandem import worker_contract as contract


def _rendered() -> dict[str, tuple[list[str], dict[str, str], str]]:
    """role -> (command, env, engine YAML) of the first example whose roles all run tp_size 1."""
    for path in example_paths():
        kids = by_kind(render(load_example(path)))
        configmap = next(c for (kind, _), c in kids.items() if kind == "ConfigMap")
        pods = {}
        for role in (contract.PREFILL, contract.DECODE):
            text = configmap["data"][f"{role}.yaml"]
            dep = next(c for (kind, name), c in kids.items() if kind == "Deployment" and name.endswith(f"-{role}"))
            container = dep["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            pods[role] = (container["command"], env, text)
        if all(contract.EngineYaml.parse(t).tp_size == 1 for _, _, t in pods.values()):
            return pods
    pytest.skip("no example with tp_size 1")


def _start(command: list[str], env: dict[str, str], yaml_text: str, model: str, tmp: Path,
           bootstrap: int) -> Worker:
    """The pod's argv with the model, config path and bootstrap port pointed at local ones."""
    args = contract.parse_worker_argv(command[2:])
    local_yaml = tmp / f"{args.role}-{contract.ENGINE_CONFIG_FILE}"
    local_yaml.write_text(yaml_text)
    swap = {args.model: model, args.config: str(local_yaml), str(args.bootstrap_port): str(bootstrap)}
    argv = ["serve", *(swap.get(a, a) for a in command[2:])]
    assert env[contract.ENV_TERMINATION_MESSAGE_PATH] == contract.TERMINATION_MESSAGE_PATH
    env = env | {contract.ENV_POD_IP: "127.0.0.1", contract.ENV_KV_PORT_BASE: str(free_port()),
                 contract.ENV_TERMINATION_MESSAGE_PATH: str(tmp / f"{args.role}-termination-log")}
    w = Worker(argv, env=env)
    w.bootstrap = bootstrap
    return w


def test_prefill_and_decode_pods_serve_disaggregated_as_rendered(model_path, tmp_path) -> None:
    pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()
    pods = _rendered()
    model, bootstrap = str(model_path("tiny")), free_port()
    command, env, text = pods[contract.DECODE]
    doc = contract.EngineYaml.parse(text)
    peers = doc.engine_args["pd_prefill_peers"]  # the prefill pods' headless Service, bootstrap port
    assert peers.endswith(f".svc.cluster.local:{contract.BOOTSTRAP_PORT}") and "-prefill-" in peers  # its generation
    local = contract.EngineYaml({**doc.engine_args, "pd_prefill_peers": f"127.0.0.1:{bootstrap}"}, doc.tp_size,
                                doc.kv_transfer).render()
    pre = _start(*pods[contract.PREFILL], model, tmp_path, bootstrap)
    dec = _start(command, env, local, model, tmp_path, bootstrap)
    try:
        for w, role in ((pre, contract.PREFILL), (dec, contract.DECODE)):
            w.wait_ready()  # decode: only once its handshake with prefill holds
            info = w.get("/get_server_info").json()
            assert info["role"] == role and info["disaggregation_mode"] == role
            engine = contract.EngineYaml.parse(pods[role][2]).engine_args
            assert all(info[k] == v for k, v in engine.items() if k != "pd_prefill_peers"), (engine, info)
        served = contract.parse_worker_argv(command[2:]).served_model_name
        body = {"model": served, "prompt": "rendered pods " * 10, "max_tokens": 4, "temperature": 0}
        r = pre.post("/v1/completions", body)
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]
        p, d = pd_post(pre, dec, "/v1/completions", body)
        assert p.status_code == 200 and d.status_code == 200 and d.json()["usage"]["completion_tokens"] == 4
        assert dec.get("/debug/pool").json()["ranks"][0]["pd"]["transferred"] == 1
        for w in (pre, dec):
            assert w.get("/health").status_code == 200 and w.pool()["whole"]
        assert not list(tmp_path.glob("*-termination-log"))  # a worker that started reports no failure
    finally:
        dec.stop()
        pre.stop()
