"""Engine.shutdown releases the model: nothing keeps the Engine, its ModelRunner (weights,
KV memory, CUDA graphs) or its scheduler processes alive once it returns, and it is safe
to call again (explicitly, from `with`, from atexit)."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_whole

from tandem import Engine
from tandem.engine import engine as engine_module
from tandem.protocol.messages import AbortReq

SMALL = {"dtype": "float32", "max_total_tokens": 1024}


# Built here rather than by the `engine` fixture: these tests are about the engine's own
# lifecycle, and the fixture keeps a reference to every engine it builds.
def _engine(model_path: Any, **config: Any) -> Engine:
    return Engine(str(model_path("tiny")), **{**SMALL, **config})


def _generate_once(eng: Engine) -> None:
    out = eng.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert len(out[0]["token_ids"]) == 2
    assert_whole(eng)  # before the shutdown under test


def test_dropped_engine_is_garbage_collected(model_path) -> None:
    # The old atexit.register(self.shutdown) held every Engine (and its model) until exit.
    eng = _engine(model_path)
    _generate_once(eng)
    ref = weakref.ref(eng)
    eng.shutdown()
    del eng
    gc.collect()
    assert ref() is None


def test_shutdown_releases_the_runner_while_the_engine_is_held(model_path) -> None:
    eng = _engine(model_path)
    _generate_once(eng)
    runner = eng.scheduler.runner
    refs = [weakref.ref(o) for o in (runner, runner.model, runner.kv_pool, runner.memory)]
    del runner
    eng.shutdown()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate([1, 2, 3], {"max_new_tokens": 1})
    eng.abort("any")  # a no-op now, so a stream's cleanup after shutdown does not raise


def test_shutdown_after_a_scheduler_error_releases_the_runner(model_path, monkeypatch) -> None:
    # The stored error's traceback holds the loop's frames, and they the runner (after an
    # OOM, the memory it failed for). Silenced excepthook: pytest's own would keep the
    # traceback until the test ends.
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    eng = _engine(model_path)
    sched = eng.scheduler

    def boom() -> None:
        raise RuntimeError("out of memory (simulated)")

    sched.get_next_batch_to_run = boom
    ref = weakref.ref(sched.runner)
    del sched
    with pytest.raises(RuntimeError, match="simulated"):
        eng.generate([1, 2, 3], {"max_new_tokens": 1})
    eng.shutdown()
    gc.collect()
    assert ref() is None
    assert "simulated" in str(eng.error)  # still reported, only the frames are gone


def test_shutdown_is_idempotent_and_with_block_shuts_down(model_path) -> None:
    with _engine(model_path) as eng:
        _generate_once(eng)
        thread = eng.backend.thread
    assert not thread.is_alive()
    assert eng.backend.scheduler is None
    assert eng not in engine_module._live_engines  # atexit has nothing left to do for it
    eng.shutdown()  # again, as a user's explicit call after `with` would
    engine_module._shutdown_live_engines()  # and as atexit would


def test_atexit_shuts_down_engines_still_alive(model_path) -> None:
    eng = _engine(model_path)
    thread = eng.backend.thread
    engine_module._shutdown_live_engines()
    assert not thread.is_alive()
    assert eng.backend.scheduler is None


def test_dp_shutdown_leaves_no_scheduler_process(model_path) -> None:
    import stat

    eng = _engine(model_path, dp_size=2)
    sockets = Path(eng.backend.sockets)
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700  # only this user reaches the schedulers
    try:
        _generate_once(eng)
        pids = [p.pid for p in eng.backend.procs]
        assert len(pids) == 2
    finally:
        eng.shutdown()
    # join() reaped them: not even a zombie is left under these pids.
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert eng.backend.procs == []
    assert not sockets.exists()
    with pytest.raises(RuntimeError, match="shut down"):  # what the server's front catches
        eng.backend.send(AbortReq("late"))
    eng.shutdown()
