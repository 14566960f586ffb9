"""The worker contract (tandem/worker_contract.py) between the operator and `tandem serve`.

What the operator renders for every example InferenceService must parse back through the
contract, and its engine.yaml must build the engine's config: the two sides cannot drift.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_support import by_kind, example_paths, load_example, render

from tandem import worker_contract as contract
from tandem.engine.engine_config import EngineConfig


def test_argv_round_trip() -> None:
    args = contract.WorkerArgs(role="decode", model="/models/m", served_model_name="org/m", port=9000,
                               bootstrap_port=9100, config="/tmp/e.yaml", extra=("--page-size", "16"),
                               tool_call_parser="llama3_json", reasoning_parser="deepseek-r1")
    argv = contract.worker_argv(args)
    assert argv[:2] == ["tandem", "serve"]
    assert contract.parse_worker_argv(argv[2:]) == args
    minimal = contract.parse_worker_argv(["--model", "tiny"])
    assert (minimal.role, minimal.served_model_name, minimal.config) == ("colocated", "tiny", None)
    with pytest.raises(ValueError, match="role"):
        contract.WorkerArgs(role="router", model="m", served_model_name="m")
    with pytest.raises(ValueError, match="tool_call_parser"):
        contract.WorkerArgs(role="colocated", model="m", served_model_name="m", tool_call_parser="xml")
    with pytest.raises(ValueError, match="reasoning_parser"):
        contract.WorkerArgs(role="colocated", model="m", served_model_name="m", reasoning_parser="o1")


def test_engine_yaml_round_trip_and_errors() -> None:
    doc = contract.EngineYaml({"page_size": 16, "schedule_policy": "lpm"}, tp_size=2,
                              kv_transfer=contract.KvTransfer(port_base=20000, port_count=8))
    assert contract.EngineYaml.parse(doc.render()) == doc
    assert contract.EngineYaml.parse("") == contract.EngineYaml()
    for bad, match in [("- 1\n- 2\n", "mapping"), ("kv_transfer: {speed: 3}\n", "kv_transfer"),
                       ("tp_size: 0\n", "tp_size"), ("kv_transfer: {backend: tcp}\n", "backend"),
                       ("kv_transfer: {port_base: 65530, port_count: 16}\n", "ports")]:
        with pytest.raises(ValueError, match=match):
            contract.EngineYaml.parse(bad)
    with pytest.raises(ValueError, match="contract keys"):
        contract.EngineYaml({"tp_size": 1})


@pytest.mark.parametrize(("tp", "heads", "kv_heads", "refused"), [
    (1, 9, 3, None), (4, 32, 8, None), (8, 64, 8, None),
    (8, 32, 4, None),  # 4 KV heads divide tp 8: each is replicated on 2 ranks
    (4, 32, None, None),  # no GQA: the KV heads are the attention heads
    (3, 32, 8, "attention heads"), (3, 9, 3, None), (6, 12, 4, "KV heads"), (5, 12, 4, "attention heads"),
    (4, 16, 6, "KV heads"), (0, 32, 8, "positive"),
])
def test_tp_head_rule(tp: int, heads: int, kv_heads: int | None, refused: str | None) -> None:
    """tp must divide the attention heads; KV heads are split (tp divides them) or replicated
    (they divide tp); anything else is refused. The engine and the operator apply this one rule."""
    problem = contract.tp_head_problem(tp, heads, kv_heads)
    assert problem is None if refused is None else refused in problem, problem


def test_termination_message_env_names_the_contract_path() -> None:
    assert contract.termination_message_env() == {"name": contract.ENV_TERMINATION_MESSAGE_PATH,
                                                  "value": contract.TERMINATION_MESSAGE_PATH}
    # A worker started outside the operator (tandem up) is not told to write one.
    names = {e["name"] for e in contract.worker_env("decode", contract.KvTransfer())}
    assert contract.ENV_TERMINATION_MESSAGE_PATH not in names


def test_kv_ports_from_env() -> None:
    assert contract.kv_from_env({}) is None
    env = {e["name"]: e["value"] for e in contract.worker_env("prefill", contract.KvTransfer(port_base=18000))
           if "value" in e}
    assert contract.kv_from_env(env) == contract.KvTransfer(port_base=18000)


def _children(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return by_kind(render(load_example(path)))


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.stem)
def test_operator_pods_speak_the_contract(path: Path) -> None:
    """Every worker pod of every example: argv parses, env carries the contract's names,
    and its engine.yaml builds an EngineConfig (unknown engine keys would raise here)."""
    kids = _children(path)
    configmap = next(c for (kind, _), c in kids.items() if kind == "ConfigMap")
    for role in (contract.PREFILL, contract.DECODE):
        dep = next(c for (kind, name), c in kids.items() if kind == "Deployment" and name.endswith(f"-{role}"))
        container = dep["spec"]["template"]["spec"]["containers"][0]
        args = contract.parse_worker_argv(container["command"][2:])
        assert args.role == role and args.config == contract.ENGINE_CONFIG_PATH
        assert args.model.startswith(contract.MODEL_MOUNT)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[contract.ENV_ROLE] == role and contract.ENV_POD_IP in env
        kv = contract.kv_from_env({k: v for k, v in env.items() if v is not None})
        text = configmap["data"][f"{role}.yaml"]
        doc = contract.EngineYaml.parse(text)
        assert doc.kv_transfer == kv
        engine_args = {k: v for k, v in doc.engine_args.items()}
        config = EngineConfig.from_kwargs(**{"tp_size": doc.tp_size, **engine_args})  # ep_size is checked against it
        assert config.page_size == engine_args.get("page_size", EngineConfig().page_size)
        # The contract's tp_size becomes the engine's (engine/parallel/, docs/tp.md).
        assert EngineConfig.from_engine_yaml(text)[0] == dataclasses.replace(config, tp_size=doc.tp_size)


def test_operator_yaml_is_plain_yaml() -> None:
    """The ConfigMap text is what `tandem serve` reads: plain YAML, sorted keys."""
    kids = _children(example_paths()[0])
    configmap = next(c for (kind, _), c in kids.items() if kind == "ConfigMap")
    for text in configmap["data"].values():
        assert yaml.safe_load(text) == yaml.safe_load(contract.EngineYaml.parse(text).render())


def test_default_ports_follow_the_serving_port() -> None:
    """Two processes started by hand on one host with their own --port share no default port
    (the README's by-hand PD stack: prefill 8100, decode 8200, router 8000); pods keep 8001/8002/8998."""
    import argparse

    from tandem.router import cli as router_cli

    def worker(*argv: str) -> tuple[int, int]:
        p = argparse.ArgumentParser()
        contract.add_worker_arguments(p)
        ns = p.parse_args(["--model", "tiny", *argv])
        return contract.admin_port(ns), contract.bootstrap_port(ns)

    def router(*argv: str) -> int:
        p = argparse.ArgumentParser()
        router_cli.register(p.add_subparsers())
        return router_cli._config(p.parse_args(["router", *argv])).admin_port

    assert worker() == (contract.ADMIN_PORT, contract.BOOTSTRAP_PORT) == (8001, 8998)
    assert router() == contract.ROUTER_ADMIN_PORT == 8002
    prefill, decode, front = worker("--port", "8100"), worker("--port", "8200"), router("--port", "8000")
    taken = [8100, *prefill, 8200, *decode[:1], 8000, front]
    assert len(set(taken)) == len(taken), taken
    assert worker("--port", "8100", "--admin-port", "0", "--bootstrap-port", "8998") == (0, 8998)
    assert worker("--port", "0") == (8001, 8998) and worker("--port", "65535") == (8001, 8998)
    assert router("--port", "9000", "--admin-port", "9100") == 9100
