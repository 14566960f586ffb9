"""The scheduler's grammar manager: constrained requests wait for their grammar here before
they join the queues, and a batch with constrained rows gets its vocabulary mask here.

    add_request -> constraint? -- compiled already --> matcher attached, admitted now
                              \\-- not yet --> grammar queue -- poll() --> admitted (or failed, 400)

The queue and the compile thread are engine/grammar/grammar_queue.py; the mask handoff
to the forward thread is engine/grammar/batch_mask.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.engine.engine_config import EngineConfig
from tandem.engine.grammar.batch_mask import BatchMask
from tandem.engine.grammar.grammar_queue import GrammarQueue
from tandem.engine.scheduler.req import Req, finish_abort
from tandem.engine.worker_batch import ModelWorkerBatch
from tandem.protocol.messages import GenerateReq

Admit = Callable[[Req, GenerateReq], None]


class GrammarManager:
    def __init__(self, config: EngineConfig, tokenizer: Callable[[], Any], vocab_size: int,
                 eos_ids: tuple[int, ...], admit: Admit, fail: Callable[[Req], None]) -> None:
        self.queue = GrammarQueue(config.grammar_backend, tokenizer, vocab_size, eos_ids,
                                  config.grammar_compile_timeout, config.grammar_cache_size)
        self.admit, self.fail = admit, fail
        # Tensor parallelism: rank 0's verdicts of this iteration (tick.py) replace this
        # process's own polling, and nothing is admitted early from the cache, so that every
        # rank admits a constrained request in the same iteration.
        self.follow = config.tp_size > 1
        self.verdicts: list[tuple[str, str | None]] = []

    @property
    def waiting(self) -> bool:
        return bool(self.queue.waiting)

    def add(self, req: Req, msg: GenerateReq) -> None:
        """Admit `req` now, or once its grammar is compiled."""
        constraint = req.sampling_params.constraint
        if constraint is not None:
            req.grammar = None if self.follow else self.queue.matcher_now(constraint)
            if req.grammar is None:
                self.queue.add(req.rid, constraint, (req, msg))
                return
        self.admit(req, msg)

    def poll(self) -> None:
        """Admit the requests whose grammar is ready; a failed compile fails its request alone."""
        if self.follow:
            ready, failed = self.queue.settle(self.verdicts)
            self.verdicts = []
        else:
            ready, failed = self.queue.poll()
        for (req, msg), matcher in ready:
            req.grammar = matcher
            self.admit(req, msg)
        for (req, _), why in failed:
            req.finished_reason = finish_abort(why)
            self.fail(req)

    def abort(self, rid: str) -> Req | None:
        item = self.queue.abort(rid)
        if item is None:
            return None
        req: Req = item[0]
        req.finished_reason = finish_abort("aborted while its grammar compiled")
        return req

    def attach_mask(self, reqs: list[Req], mwb: ModelWorkerBatch) -> BatchMask | None:
        """Give a batch with constrained rows its (still unfilled) vocabulary mask."""
        if any(r.grammar is not None for r in reqs):
            mwb.grammar = BatchMask(self.queue.backend(), [r.grammar for r in reqs])
        return mwb.grammar

    def status(self) -> dict[str, int]:
        return self.queue.status()

    def shutdown(self) -> None:
        self.queue.shutdown()


def fill_or_fail(mask: BatchMask) -> None:
    """Fill a launched batch's mask; if that raises, the forward thread gets the error (and
    fails the batch's requests) instead of waiting for a mask forever."""
    try:
        mask.fill()
    except Exception as exc:  # noqa: BLE001 - handed over to the forward thread, not swallowed
        mask.fail(exc)
