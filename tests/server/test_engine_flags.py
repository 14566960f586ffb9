"""`tandem serve`'s engine flags: every EngineConfig option, under SGLang's names."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tandem.engine.engine_config import EngineConfig
from tandem.server.config import add_engine_arguments


def _parse(*argv: str) -> dict[str, object]:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return {k.removeprefix("engine_"): v for k, v in vars(p.parse_args(list(argv))).items()}


def test_every_option_is_a_flag_and_unset_flags_leave_the_config_alone() -> None:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    flags = {a.dest.removeprefix("engine_") for a in p._actions if a.dest.startswith("engine_")}
    skipped = {"model", "pd_bootstrap_host", "pd_bootstrap_port"}  # from --model, --host, --bootstrap-port
    assert flags == {f.name for f in dataclasses.fields(EngineConfig)} - skipped
    assert _parse() == {}


def test_a_switch_that_defaults_to_a_decision_can_be_set_either_way() -> None:
    """bool | None options (None: decided at start-up) take --x and --no-x: the CUDA-core decode
    kernel is --no-decode-tensor-cores, overlap on CPU --no-disable-overlap-schedule."""
    assert _parse("--no-decode-tensor-cores", "--no-disable-overlap-schedule") == {
        "decode_tensor_cores": False, "disable_overlap_schedule": False}
    assert _parse("--decode-tensor-cores") == {"decode_tensor_cores": True}
    plain = _parse("--disable-radix-cache", "--layer-ops", "torch")
    assert plain == {"disable_radix_cache": True, "layer_ops": "torch"}
    cfg = EngineConfig.from_kwargs(**_parse("--no-decode-tensor-cores"))
    assert cfg.runner_config().decode_tensor_cores is False


def test_a_switch_given_anything_but_a_boolean_is_refused() -> None:
    """From an engine YAML (engine.extra in the CR) a quoted "false" would have read as true."""
    for bad in ("false", 0, "yes"):
        with pytest.raises(ValueError, match="decode_tensor_cores must be true, false or null"):
            EngineConfig.from_kwargs(decode_tensor_cores=bad)
    assert EngineConfig.from_kwargs(decode_tensor_cores=None).decode_tensor_cores is None
