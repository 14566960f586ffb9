"""The operator's pods start `tandem serve` exactly as rendered: the argv, env and engine
YAML of a reconciled InferenceService, with only the model mount and the config path
pointed at local files and the port moved to a free one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from worker_process import Worker, free_port

from tandem import worker_contract as contract

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
from operator_support import example_paths, load_example  # noqa: E402

from tandem.operator.reconcile import reconcile  # noqa: E402


def _rendered(role: str) -> tuple[list[str], dict[str, str], str]:
    for path in example_paths():
        kids = {(c["kind"], c["metadata"]["name"]): c for c in reconcile(load_example(path))}
        configmap = next(c for (kind, _), c in kids.items() if kind == "ConfigMap")
        text = configmap["data"][f"{role}.yaml"]
        if contract.EngineYaml.parse(text).tp_size != 1:
            continue
        dep = next(c for (kind, name), c in kids.items() if kind == "Deployment" and name.endswith(f"-{role}"))
        container = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        return container["command"], env, text
    pytest.skip("no example with tp_size 1")


@pytest.mark.parametrize("role", [contract.PREFILL, contract.DECODE])
def test_worker_starts_from_the_operators_pod(role, model_path, tmp_path) -> None:
    command, env, yaml_text = _rendered(role)
    assert command[:2] == ["tandem", "serve"]
    args = contract.parse_worker_argv(command[2:])
    local_yaml = tmp_path / contract.ENGINE_CONFIG_FILE
    local_yaml.write_text(yaml_text)
    model = str(model_path("tiny"))
    argv = ["serve", *(model if a == args.model else str(local_yaml) if a == args.config else a
                       for a in command[2:])]
    env |= {contract.ENV_POD_IP: "127.0.0.1", contract.ENV_KV_PORT_BASE: str(free_port())}
    with Worker(argv, env=env) as w:
        info = w.get("/get_server_info").json()
        assert info["role"] == role and info["served_model_name"] == args.served_model_name
        engine = contract.EngineYaml.parse(yaml_text).engine_args
        assert all(info[k] == v for k, v in engine.items()), (engine, info)
        r = w.post("/v1/completions", {"model": args.served_model_name, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 501 and "colocated" in r.json()["error"]["message"]
        assert w.get("/health").status_code == 200
        assert w.pool()["whole"]
