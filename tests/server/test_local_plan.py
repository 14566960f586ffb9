"""`tandem up`'s plan: the command lines, env and engine YAML come from the worker contract
(as the operator writes them), and every port is distinct. torch-free, no process started."""

from __future__ import annotations

import pytest

from tandem import worker_contract as contract
from tandem.cli import build_parser
from tandem.local.plan import PROGRAM, ROUTER, Ports, UpConfig, bootstrap_port, plan


def _cfg(tmp_path, **kw):
    return UpConfig(model="/models/tiny", served_model_name="tiny", run_dir=tmp_path, port=18000, **kw)


def _router_args(comp):
    pytest.importorskip("fastapi")
    return build_parser(("tandem.router.cli",)).parse_args(list(comp.argv[len(PROGRAM):]))


def test_pd_plan_uses_the_contract(tmp_path):
    comps = plan(_cfg(tmp_path, prefill=2, decode=1, worker_args=("--page-size", "16")))
    assert [c.name for c in comps] == ["prefill-0", "prefill-1", "decode-0", ROUTER]
    prefill, decode = comps[:2], comps[2]
    for c in comps[:3]:
        args = contract.parse_worker_argv(c.argv[len(PROGRAM) + 1:])
        assert (args.role, args.model, args.served_model_name, args.port) == (c.role, "/models/tiny", "tiny", c.port)
        assert args.extra == ("--page-size", "16")
        doc = contract.EngineYaml.parse(c.files[args.config])
        assert doc.kv_transfer.port_base == int(c.env[contract.ENV_KV_PORT_BASE])
        assert c.env[contract.ENV_ROLE] == c.role and c.env[contract.ENV_POD_NAME] == c.name
    peers = contract.EngineYaml.parse(next(iter(decode.files.values()))).engine_args["pd_prefill_peers"]
    assert peers == ",".join(f"127.0.0.1:{bootstrap_port(p)}" for p in prefill)
    router = _router_args(comps[-1])
    assert router.prefill == [f"{p.url}={bootstrap_port(p)}" for p in prefill] and router.decode == [decode.url]
    assert (router.port, router.tokenizer, router.model_name) == (18000, "/models/tiny", "tiny")


def test_ports_and_kv_ranges_are_distinct(tmp_path):
    comps = plan(_cfg(tmp_path, prefill=2, dp=3))
    http = [c.port for c in comps]
    boots = [bootstrap_port(c) for c in comps if c.role == contract.PREFILL]
    assert len(set(http + boots)) == len(http) + len(boots)
    ranges = [range(int(c.env[contract.ENV_KV_PORT_BASE]), int(c.env[contract.ENV_KV_PORT_BASE])
                    + int(c.env[contract.ENV_KV_PORT_COUNT])) for c in comps if c.name != ROUTER]
    assert sum(len(r) for r in ranges) == len(set().union(*ranges))
    assert not set(http).intersection(*ranges)


def test_colocated_dp_plan(tmp_path):
    comps = plan(_cfg(tmp_path, colocated=True, dp=3))
    assert [c.role for c in comps] == [contract.COLOCATED] * 3 + [ROUTER]
    assert _router_args(comps[-1]).workers == [c.url for c in comps[:3]]


def test_bad_counts_and_the_port_block(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        _cfg(tmp_path, prefill=0)
    ports = Ports()
    a, b = ports.block(4, start=40000), ports.block(4, start=40000)
    assert b >= a + 4


def test_workers_get_disjoint_cores(tmp_path):
    from tandem.local.plan import share_cores

    assert share_cores((0, 1), 2) == [(0,), (1,)] and share_cores((0, 1, 2, 3), 3) == [(0,), (1,), (2, 3)]
    assert share_cores((0, 1), 3) == [(0,), (1,), (0,)]
    comps = plan(_cfg(tmp_path, cpus=(0, 1, 2, 3)))
    assert [c.cpus for c in comps] == [(0, 1), (2, 3), ()]  # the router floats


def test_pd_workers_share_a_secret_made_for_the_run(tmp_path):
    from tandem.pd.secret import check_pd_secret

    comps, other_run = plan(_cfg(tmp_path, prefill=2, decode=2)), plan(_cfg(tmp_path))
    secrets = {c.env.get(contract.ENV_PD_SECRET) for c in comps if c.name != ROUTER}
    assert len(secrets) == 1 and check_pd_secret(secrets.pop())
    assert other_run[0].env[contract.ENV_PD_SECRET] != comps[0].env[contract.ENV_PD_SECRET]
    assert contract.ENV_PD_SECRET not in comps[-1].env  # the router takes no part in PD traffic
    assert all(contract.ENV_PD_SECRET not in c.env for c in plan(_cfg(tmp_path, colocated=True, dp=2)))


def test_up_defaults_to_the_real_model():
    """The README's first command is a bare `tandem up`: it must serve the real instruct model."""
    from pathlib import Path

    from tandem.cli import build_parser

    assert build_parser().parse_args(["up"]).model == "smollm2"
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    first = next(line for line in readme.splitlines() if line.startswith("python3 -m venv"))
    assert first.endswith("&& tandem up")


@pytest.mark.parametrize("colocated", [False, True])
def test_deterministic_reaches_every_worker_yaml(tmp_path, colocated):
    for on in (True, False):
        comps = plan(_cfg(tmp_path, colocated=colocated, deterministic=on))
        for c in comps[:-1]:
            args = contract.parse_worker_argv(c.argv[len(PROGRAM) + 1:])
            assert contract.EngineYaml.parse(c.files[args.config]).engine_args.get("deterministic", False) is on


def test_up_flag_is_on_unless_refused():
    from tandem.cli import build_parser

    assert build_parser().parse_args(["up"]).deterministic is None  # decided by the device at start-up
    assert build_parser().parse_args(["up", "--no-deterministic"]).deterministic is False
