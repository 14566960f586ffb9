"""Every way a request ends goes through lifecycle.retire, once (engine/scheduler/lifecycle.py).

The scenario ends requests each way a colocated scheduler knows: a length, a stop token, a
client's abort while waiting, chunking or decoding, a grammar that does not compile, a failed
batch, the waiting and running timeouts, and the engine's shutdown. For each it checks that
retire ended it exactly once, that exactly one output said it finished, that the metrics
counted it once (by reason), and that the pools are whole after. Both loops; TP 2 runs the
same scenario in its own processes and is checked from outside (metrics and pools). Every
idle scheduler also checks that each request it received was retired once
(Lifecycle.check_integrity), so every scenario test in the suite checks it too: the PD roles'
endings in tests/pd/test_pd_faults.py.
"""

from __future__ import annotations

import ast
import collections
import threading
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_whole

from tandem import Engine
from tandem.engine.scheduler.lifecycle import Lifecycle
from tandem.engine.scheduler.output_processor import OutputProcessor

ROOT = Path(__file__).resolve().parents[2]
BAD_SEED = 4242
LONG = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}  # far more than a test waits for
BAD_SCHEMA = '{"type": "object", "properties": {"a": {"type": "nope"}}}'


class Spy:
    """Counts, per request id, the retire calls that ended it and the outputs that said so.
    Installed on the classes before the engine is built: the scheduler hands out bound methods."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.retired: collections.Counter[str] = collections.Counter()
        self.final: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        retire, make_output = Lifecycle.retire, OutputProcessor.make_output

        def spy_retire(life: Lifecycle, req: Any, reason: Any, *args: Any, **kw: Any) -> None:
            if not req.finished():
                with self.lock:
                    self.retired[req.rid] += 1
            retire(life, req, reason, *args, **kw)

        def spy_output(req: Any) -> Any:
            out = make_output(req)
            if out.finished:
                with self.lock:
                    self.final[req.rid] += 1
            return out

        monkeypatch.setattr(Lifecycle, "retire", spy_retire)
        monkeypatch.setattr(OutputProcessor, "make_output", staticmethod(spy_output))


def _kind(handle: Any) -> str:
    _, last = handle.result(timeout=120)
    return last.finish_reason["kind"]


def run_scenario(eng: Engine, in_process: bool) -> dict[str, str]:
    """End requests each way; returns {rid: the finish kind it got}."""
    h = eng.submit([7, 8, 9], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    ref, _ = h.result(timeout=60)
    kinds = {h.rid: "length"}
    stop = next(t for i, t in enumerate(ref) if i >= 1 and t not in ref[:i])
    for ids, sp, want in [
        ([1, 2, 3], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, "length"),
        ([7, 8, 9], {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}, "stop"),
        ([4, 5], {"max_new_tokens": 8, "json_schema": BAD_SCHEMA}, "abort"),  # does not compile: 400
    ]:
        h = eng.submit(ids, sp)
        kinds[h.rid] = _kind(h)
        assert kinds[h.rid] == want, (sp, kinds[h.rid])
    # A client's abort while decoding, chunking (290 tokens in chunks of 16) and waiting
    # (max_running_requests=2: the third waits for a slot).
    running = eng.submit([1, 2, 3, 4], LONG)
    chunked = eng.submit(list(range(10, 300)), LONG)
    waiting = eng.submit([5, 6, 7], LONG)
    assert not running.next(timeout=60).finished
    for h in (waiting, chunked, running):
        h.abort()
    for h in (waiting, chunked, running):
        kinds[h.rid] = _kind(h)
        assert kinds[h.rid] == "abort"
    if in_process:  # a failed batch: its forward raises (batch_faults.py)
        sched = eng.scheduler
        forward = sched.worker.forward_batch_generation

        def failing(mwb: Any, *args: Any, **kw: Any) -> Any:
            if any(p.seed == BAD_SEED for p in mwb.sampling_params):
                raise ValueError("injected forward fault")
            return forward(mwb, *args, **kw)

        sched.worker.forward_batch_generation = failing
        try:
            h = eng.submit([3, 1, 4], {**LONG, "max_new_tokens": 8, "seed": BAD_SEED, "temperature": 0.5})
            _, last = h.result(timeout=60)
            kinds[h.rid] = last.finish_reason["kind"]
            assert kinds[h.rid] == "abort" and last.finish_reason["status"] == 500
        finally:
            del sched.worker.forward_batch_generation
    return kinds


def _check(eng: Engine, kinds: dict[str, str], spy: Spy | None = None) -> None:
    """Each request ended once (retire, when a spy watched) with one final output; the metrics
    counted each once by reason; none is left registered; the pools are whole."""
    if spy is not None:
        assert all(spy.retired[rid] == 1 for rid in kinds), {r: spy.retired[r] for r in kinds}
        assert all(spy.final[rid] == 1 for rid in kinds), {r: spy.final[r] for r in kinds}
    info = eng.status()[0].info
    assert info["metrics"]["finished"] == dict(collections.Counter(kinds.values())), info["metrics"]
    assert (info["requests"]["registered"], info["requests"]["held"]) == (0, 0)
    assert_whole(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_every_ending_goes_through_retire_once(engine, monkeypatch, overlap: bool) -> None:
    spy = Spy(monkeypatch)
    eng = engine(max_total_tokens=4096, max_running_requests=2, chunked_prefill_size=16,
                 disable_overlap_schedule=not overlap)
    _check(eng, run_scenario(eng, in_process=True), spy)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_timeouts_and_shutdown_end_through_retire_once(engine, monkeypatch, overlap: bool) -> None:
    spy = Spy(monkeypatch)
    eng = engine(max_total_tokens=4096, max_running_requests=1, waiting_timeout=0.2, running_timeout=1.0,
                 disable_overlap_schedule=not overlap)
    sp = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}  # the running timeout ends it first
    runs, waits = eng.submit([1, 2, 3], sp), eng.submit([4, 5, 6], sp)
    kinds = {h.rid: _kind(h) for h in (runs, waits)}
    assert set(kinds.values()) == {"abort"}
    _check(eng, kinds, spy)
    # Shutdown with a request decoding: it ends with a 503 a router may retry, its KV released.
    sched = eng.scheduler
    h = eng.submit([9, 9, 9], sp)  # shut down right after its first token, long before its timeout
    assert not h.next(timeout=60).finished
    eng.shutdown()
    _, last = h.result(timeout=60)
    assert last.finish_reason["kind"] == "abort" and last.finish_reason["status"] == 503
    assert spy.retired[h.rid] == 1 and spy.final[h.rid] == 1
    assert not sched.reqs and sched.metrics.finished["abort"] == 3
    sched.cache.check_integrity()


def test_every_ending_is_counted_once_under_tensor_parallelism(engine) -> None:
    """TP 2 (two scheduler processes, rank 0's clock and verdicts): the same endings, checked
    from outside: each counted once by reason, none left registered, every rank's pool whole."""
    eng = engine(tp_size=2, max_total_tokens=4096, max_running_requests=2, chunked_prefill_size=16)
    _check(eng, run_scenario(eng, in_process=False))


# ---- the one owner, in the source ---------------------------------------------------------------
OWNER = ROOT / "engine" / "scheduler" / "lifecycle.py"
SOURCES = [p for d in ("engine", "prefill", "decode", "tandem", "router", "operator") for p in (ROOT / d).rglob("*.py")]


def _endings(path: Path) -> list[str]:
    """Where `path` ends a request by hand: assigns a finish field, pops the registry, or
    joins the running batch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr in ("finished_reason", "to_finish"):
                    found.append(f"{path.name}:{node.lineno} assigns {el.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if (name, node.func.attr) in (("reqs", "pop"), ("running_batch", "merge_batch")):
                found.append(f"{path.name}:{node.lineno} calls {name}.{node.func.attr}")
    return found


def test_only_the_lifecycle_module_ends_a_request() -> None:
    assert _endings(OWNER)  # the check sees the owner's own endings
    bad = [e for p in SOURCES if p.resolve() != OWNER.resolve() and "tests" not in p.parts for e in _endings(p)]
    assert not bad, bad
