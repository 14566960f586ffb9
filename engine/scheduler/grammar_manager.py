"""The scheduler's grammar manager: constrained requests wait for their grammar here before
they join the queues, a batch with constrained rows gets its vocabulary mask here, and a
request whose grammar costs too much to follow is ended here.

    add_request -> constraint? -- compiled already --> matcher attached, admitted now
                              \\-- not yet --> grammar queue -- poll() --> admitted (or failed, 400)

The queue and the compile processes are engine/grammar/grammar_queue.py; the mask handoff
to the forward thread is engine/grammar/batch_mask.py; the per-request matcher budget is
engine/grammar/matcher_budget.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.engine.engine_config import EngineConfig
from tandem.engine.grammar.backend import Matcher
from tandem.engine.grammar.batch_mask import BatchMask
from tandem.engine.grammar.compile_pool import PoolLimits
from tandem.engine.grammar.grammar_queue import GrammarQueue, Verdict
from tandem.engine.grammar.matcher_budget import MeteredMatcher
from tandem.engine.scheduler.req import FinishReason, Req, finish_abort
from tandem.engine.worker_batch import ModelWorkerBatch
from tandem.protocol.messages import GenerateReq

Admit = Callable[[Req, GenerateReq], None]
End = Callable[[Req, FinishReason], object]
BudgetVerdict = tuple[str, str]  # (rid, why its grammar costs too much)


class GrammarManager:
    def __init__(self, config: EngineConfig, tokenizer: Callable[[], Any], vocab_size: int,
                 eos_ids: tuple[int, ...], admit: Admit, fail: End, end: End) -> None:
        self.budget, self.window = config.grammar_matcher_budget, config.grammar_matcher_window
        # Tensor parallelism: rank 0's verdicts of this iteration (tick.py) replace this
        # process's own polling, and nothing is admitted early from the cache, so that every
        # rank admits a constrained request in the same iteration. The CPU time a matcher
        # takes differs between ranks too: rank 0's meter decides which requests end.
        self.follow = config.tp_size > 1
        limits = PoolLimits(workers=config.grammar_compile_workers, max_pending=config.grammar_compile_queue,
                            max_bytes=config.grammar_max_bytes, probe_limit=self.budget * self.window)
        self.queue = GrammarQueue(config.grammar_backend, tokenizer, vocab_size, eos_ids,
                                  config.grammar_compile_timeout, config.grammar_cache_size,
                                  config.grammar_cache_bytes, limits, follow=self.follow)
        # fail: retire one that never started (lifecycle.retire); end: one that runs (lifecycle.end)
        self.admit, self.fail, self.end = admit, fail, end
        self.verdicts: list[Verdict] = []
        self.budget_verdicts: list[BudgetVerdict] = []
        self.metered: dict[str, Req] = {}  # admitted constrained requests
        self.over_budget = 0

    @property
    def waiting(self) -> bool:
        return bool(self.queue.waiting)

    def add(self, req: Req, msg: GenerateReq) -> None:
        """Admit `req` now, or once its grammar is compiled."""
        constraint = req.sampling_params.constraint
        if constraint is not None:
            matcher = None if self.follow else self.queue.matcher_now(constraint)
            if matcher is None:
                self.queue.add(req.rid, constraint, (req, msg))
                return
            self._attach(req, matcher)
        self.admit(req, msg)

    def decide(self) -> tuple[list[Verdict], list[BudgetVerdict]]:
        """Rank 0: which grammars are compiled (or failed), and which requests went over their
        matcher budget (tick.py hands both to every rank)."""
        return self.queue.decide(), self._over_budget()

    def poll(self) -> None:
        """Admit the requests whose grammar is ready (a failed compile fails its request alone),
        and end those whose grammar went over budget. Runs after the iteration's messages, on
        every rank alike."""
        if self.follow:
            verdicts, budget = self.verdicts, self.budget_verdicts
            self.verdicts, self.budget_verdicts = [], []
        else:
            verdicts, budget = self.decide()
        ready, failed = self.queue.settle(verdicts) if verdicts else ([], [])
        for (req, msg), matcher in ready:
            self._attach(req, matcher)
            self.admit(req, msg)
        for (req, _), why, status in failed:
            self.fail(req, finish_abort(why, status=status))
        self._enforce(budget)

    def abort(self, rid: str) -> Req | None:
        """Take a request still waiting for its grammar out of the queue (the caller retires it)."""
        item = self.queue.abort(rid)
        return None if item is None else item[0]

    def attach_mask(self, reqs: list[Req], mwb: ModelWorkerBatch) -> BatchMask | None:
        """Give a batch with constrained rows its (still unfilled) vocabulary mask."""
        if any(r.grammar is not None for r in reqs):
            mwb.grammar = BatchMask(self.queue.backend(), [r.grammar for r in reqs])
        return mwb.grammar

    def status(self) -> dict[str, int]:
        return {**self.queue.status(), "grammar_over_budget": self.over_budget}

    def shutdown(self) -> None:
        self.queue.shutdown()

    # ---- the matcher budget -------------------------------------------------------------------
    def _attach(self, req: Req, matcher: Matcher) -> None:
        req.grammar = MeteredMatcher(matcher, self.budget, self.window)
        self.metered[req.rid] = req

    def _over_budget(self) -> list[BudgetVerdict]:
        out: list[BudgetVerdict] = []
        for rid, req in self.metered.items():
            why = None if req.finished() or req.to_finish is not None else req.grammar.over_budget()
            if why is not None:
                out.append((rid, why))
        return out

    def _enforce(self, verdicts: list[BudgetVerdict]) -> None:
        """End each request named, the way an abort ends a running one: at its next result,
        which frees its pages. A request already ending (aborted in this same tick) is left
        to that; its matcher does no more work either way."""
        for rid, why in verdicts:
            req = self.metered.get(rid)
            if req is None or req.finished():
                continue
            req.grammar.halted = True
            if self.end(req, finish_abort(why)):
                self.over_budget += 1
        if self.metered:
            self.metered = {rid: r for rid, r in self.metered.items() if not r.finished()}


def fill_or_fail(mask: BatchMask) -> None:
    """Fill a launched batch's mask; if that raises, the forward thread gets the error (and
    fails the batch's requests) instead of waiting for a mask forever."""
    try:
        mask.fill()
    except Exception as exc:  # noqa: BLE001 - handed over to the forward thread, not swallowed
        mask.fail(exc)
