"""A worker's fatal start-up error lands in the file Kubernetes reads as the container's termination
message (tandem/server/start_failure.py), from the config (cli.py) and from the model load (app.py's
lifespan); the operator turns it into the WorkersFailing condition."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tandem import worker_contract as contract
from tandem.server.start_failure import (
    bounded,
    reported_start_failure,
    reporting_lifespan,
    write_start_failure,
)

LIMIT = contract.TERMINATION_MESSAGE_MAX_BYTES


def env_for(path: Path) -> dict[str, str]:
    return {contract.ENV_TERMINATION_MESSAGE_PATH: str(path)}


def test_writes_only_where_the_env_says(tmp_path: Path) -> None:
    target = tmp_path / "termination-log"
    assert not write_start_failure("boom", environ={})
    assert not target.exists()
    assert write_start_failure("boom", environ=env_for(target))
    assert target.read_text() == "boom"
    # An unwritable path is logged, never raised: the error being reported matters more.
    assert not write_start_failure("boom", environ=env_for(tmp_path / "missing-dir" / "log"))


@pytest.mark.parametrize("message", ["x" * (LIMIT * 3), "é" * LIMIT, "€" * LIMIT])
def test_the_message_is_bounded_to_4_kib_on_a_character_boundary(tmp_path: Path, message: str) -> None:
    target = tmp_path / "termination-log"
    write_start_failure(message, environ=env_for(target))
    data = target.read_bytes()
    assert len(data) <= LIMIT and data.decode("utf-8").endswith("…")
    assert message.startswith(data.decode("utf-8")[:-1])  # the head is kept
    assert bounded("short") == b"short"


def test_config_errors_are_recorded_and_re_raised(tmp_path: Path) -> None:
    target = tmp_path / "termination-log"
    with pytest.raises(ValueError, match="tp_size"), reported_start_failure(env_for(target)):
        raise ValueError("tp_size 3 does not divide the model's 32 attention heads")
    assert target.read_text() == "start-up failed: ValueError: tp_size 3 does not divide the model's 32 attention heads"
    with pytest.raises(SystemExit), reported_start_failure(env_for(target)):
        raise SystemExit("--config /etc/tandem/engine.yaml: no such file")
    assert target.read_text() == "start-up failed: --config /etc/tandem/engine.yaml: no such file"
    target.unlink()
    with pytest.raises(SystemExit), reported_start_failure(env_for(target)):
        raise SystemExit(0)  # an exit code alone carries nothing to report
    assert not target.exists()


def test_the_lifespan_records_a_failed_start_not_a_failed_shutdown(tmp_path: Path) -> None:
    target = tmp_path / "termination-log"

    def failing(at: str) -> Any:
        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            if at == "start":
                raise RuntimeError("scheduler ready-0 failed to start: ValueError: tp_size 3")
            yield
            raise RuntimeError("shutdown trouble")

        return reporting_lifespan(lifespan, env_for(target))

    async def enter_and_leave(at: str) -> None:
        async with failing(at)(None):
            pass

    with pytest.raises(RuntimeError, match="shutdown trouble"):
        asyncio.run(enter_and_leave("stop"))
    assert not target.exists()
    with pytest.raises(RuntimeError, match="failed to start"):
        asyncio.run(enter_and_leave("start"))
    assert target.read_text() == ("start-up failed: RuntimeError: scheduler ready-0 failed to start: "
                                  "ValueError: tp_size 3")


def test_a_worker_app_whose_schedulers_refuse_to_start_reports_it(model_path: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The real app: the scheduler processes fail as a rank refusing its tp_size does."""
    from tandem.engine.engine_config import EngineConfig
    from tandem.server.app import build_app
    from tandem.server.config import ServerConfig

    target = tmp_path / "termination-log"
    monkeypatch.setenv(contract.ENV_TERMINATION_MESSAGE_PATH, str(target))

    def refuse(emit: Any) -> Any:
        raise RuntimeError("scheduler ready-0 failed to start: ValueError: tp_size 3 does not divide the model's "
                           "4 attention heads")

    config = ServerConfig(role="colocated", model_path=str(model_path("tiny")), served_model_name="tiny",
                          engine=EngineConfig())
    with pytest.raises(RuntimeError, match="tp_size 3"), TestClient(build_app(config, client_factory=refuse)):
        pass
    assert target.read_text().startswith("start-up failed: RuntimeError: scheduler ready-0 failed to start")


def test_tandem_serve_with_a_bad_engine_yaml_writes_its_termination_message(tmp_path: Path) -> None:
    config, target = tmp_path / "engine.yaml", tmp_path / "termination-log"
    config.write_text(contract.EngineYaml({"no_such_option": 1}).render())
    argv = contract.worker_argv(contract.WorkerArgs(role="decode", model="tiny", served_model_name="tiny",
                                                    config=str(config)), program=(sys.executable, "-m", "tandem.cli"))
    done = subprocess.run(argv, env={**os.environ, **env_for(target)}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert target.read_text() == "start-up failed: TypeError: unknown engine options: ['no_such_option']", done.stderr
