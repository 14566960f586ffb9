"""The matcher budget (engine/grammar/matcher_budget.py): a request whose grammar costs the
scheduler too much CPU per token ends alone, with a 400 naming why; its neighbours and the
pools are untouched. A grammar slow from its first token is refused before it runs.

Finding: an ambiguous EBNF (nested stars over overlapping alternatives) made the matcher's
per-token cost grow with the output, 7 ms at token 40 and 369 ms at token 120, on the
scheduler thread, for every request of the batch, with no budget at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_whole
from waits import wait_until

from tandem.engine.grammar.compile_pool import PoolLimits
from tandem.engine.grammar.grammar_queue import GrammarQueue
from tandem.engine.grammar.matcher_budget import MeteredMatcher

# Only runs of "x" are allowed, never the stop token (the empty class at the end cannot
# match), and every "x" is ambiguous five levels deep: the matcher's work grows with each one.
PATHOLOGICAL = 'root ::= ((((("x" | "xx")*)*)*)*)* [^\\x00-\\U0010FFFF]'
# Its first mask alone takes tens of ms of CPU (alternatives of overlapping bounded runs).
SLOW_FIRST_MASK = "root ::= (" + " | ".join(f"[a-z]{{0,{j}}}" for j in range(1, 14)) + ")*"


class _FakeMatcher:
    """Each call advances a fake CPU clock by a set cost: the budget is a count, not a race."""

    def __init__(self, clock: list[float], costs: list[float]) -> None:
        self.clock, self.costs = clock, costs

    def _work(self) -> None:
        self.clock[0] += self.costs.pop(0) if self.costs else 0.0

    def accept(self, token: int) -> bool:
        self._work()
        return True

    def fill_mask(self, mask: Any, row: int) -> None:
        self._work()

    def is_terminated(self) -> bool:
        return False


def _metered(costs: list[float], per_token: float, window: int) -> MeteredMatcher:
    clock = [0.0]
    return MeteredMatcher(_FakeMatcher(clock, costs), per_token, window, clock=lambda: clock[0])


def test_the_average_over_the_window_decides() -> None:
    m = _metered([0.004, 0.004] * 8 + [0.03, 0.03], per_token=0.01, window=4)
    for _ in range(8):  # 8 ms a token: under 10
        m.fill_mask(None, 0)
        m.accept(1)
        assert m.over_budget() is None
    m.fill_mask(None, 0)
    m.accept(1)  # the window now holds 8, 8, 8, 60 ms: 84 > 40
    why = m.over_budget()
    assert why is not None and "too costly" in why and "10 ms a token" in why


def test_one_slow_mask_counts_before_its_token_is_accepted() -> None:
    m = _metered([0.5], per_token=0.01, window=4)
    m.fill_mask(None, 0)
    assert m.over_budget() is not None


def test_a_halted_matcher_does_no_more_work() -> None:
    m = _metered([1.0], per_token=0.01, window=4)
    m.halted = True
    m.fill_mask(None, 0)
    assert m.pending == 0.0


def test_a_grammar_slow_from_its_first_token_is_refused_at_compile(model_path: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path("tiny"))
    q = GrammarQueue("xgrammar", lambda: tok, 8192, [tok.eos_token_id], timeout=120,
                     limits=PoolLimits(probe_limit=0.005))
    try:
        q.add("slow", ("ebnf", SLOW_FIRST_MASK), "slow")
        q.add("fine", ("regex", "[ab]+"), "fine")
        ready: list[Any] = []
        failed: list[Any] = []
        wait_until(lambda: (lambda r, f: (ready.extend(r), failed.extend(f), not q.waiting)[2])(*q.poll()),
                   120, "the compiles")
        assert [item for item, _ in ready] == ["fine"]
        assert failed[0][0] == "slow" and "first vocabulary mask took" in failed[0][1] and failed[0][2] == 400
    finally:
        q.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_pathological_grammar_ends_its_request_alone(model_path: Any, overlap: bool) -> None:
    from tandem import Engine

    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=2048, page_size=4,
                disable_overlap_schedule=not overlap,
                grammar_matcher_budget=0.001, grammar_matcher_window=4) as eng:
        outs = eng.generate(["a", "b", "c"], [
            {"max_new_tokens": 96, "temperature": 0.0, "ebnf": PATHOLOGICAL},
            {"max_new_tokens": 24, "temperature": 0.0, "regex": "[0-9]+"},
            {"max_new_tokens": 24, "temperature": 0.0}])
        bad, regex, free = outs
        assert bad["finish_reason"] == "abort" and "too costly" in bad["meta"]["finish_message"], bad
        assert set(bad["text"]) == {"x"} and len(bad["token_ids"]) < 96
        assert regex["finish_reason"] in ("stop", "length") and regex["text"].isdigit(), regex
        assert free["finish_reason"] == "length"
        assert eng.status()[0].info["grammar"]["grammar_over_budget"] == 1
        assert_whole(eng)
        pids = eng.scheduler.grammar.queue.pool.pids()
    assert pids and not [p for p in pids if Path(f"/proc/{p}").exists()]  # shutdown ends the compile processes


def _end_later(req, why) -> bool:
    """lifecycle.end for a running request: the first reason wins."""
    if req.to_finish is not None:
        return False
    req.to_finish = why
    return True


def test_rank_zeros_verdicts_for_requests_that_left_in_the_same_tick_are_dropped() -> None:
    """Tensor parallelism: rank 0 decides before the tick's aborts are applied; every rank
    applies the aborts first, then drops the verdicts that no longer have a request to take."""
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.scheduler.grammar_manager import GrammarManager
    from tandem.engine.scheduler.req import Req, finish_abort

    mgr = GrammarManager(EngineConfig(tp_size=2), lambda: None, 8192, (0,),
                         admit=lambda req, msg: None, fail=lambda req, why: None, end=_end_later)
    try:
        a, b = Req("a", [1], SamplingParams()), Req("b", [1], SamplingParams())
        for r in (a, b):
            mgr._attach(r, _FakeMatcher([0.0], []))
        b.to_finish = finish_abort("aborted by client")  # the tick's abort, applied first
        mgr.verdicts = [("gone", None, 0)]  # its grammar compiled, but it was aborted meanwhile
        mgr.budget_verdicts = [("a", "too costly"), ("b", "too costly"), ("gone", "too costly")]
        mgr.poll()
        assert a.to_finish is not None and a.to_finish.message == "too costly" and a.to_finish.status == 400
        assert b.to_finish.message == "aborted by client"
        assert a.grammar.halted and b.grammar.halted and mgr.status()["grammar_over_budget"] == 1
    finally:
        mgr.shutdown()
