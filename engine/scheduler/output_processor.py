"""process_batch_result: turn sampled ids into request progress and outputs.

Under overlap, a batch's results are processed one step late, so a request may
already be finished or retracted when its row comes back: such rows are stale
and skipped (a retracted request re-derives the token after re-prefill, and
seeded sampling makes it the same token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.runner.model_worker import GenerationBatchResult
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.req import FinishReason, Req, finish_abort, finish_length
from tandem.engine.scheduler.schedule_batch import ScheduleBatch
from tandem.protocol.messages import ReqOutput


class OutputProcessor:
    def __init__(
        self,
        cache: CacheManager,
        eos_ids: tuple[int, ...],
        tokenizer: Callable[[], Any],
        emit: Callable[[list[ReqOutput]], None],
    ) -> None:
        self.cache = cache
        self.eos_ids = frozenset(eos_ids)
        self.tokenizer = tokenizer  # loaded lazily: only stop strings need it
        self.emit = emit
        # How a request found finished here ends: lifecycle.retire (wired by the scheduler).
        self.retire: Callable[[Req, FinishReason], None] = lambda req, reason: None
        self.pending: list[Req] = []  # requests with output to send at the next flush

    # ---- per batch ------------------------------------------------------------------------------
    def process_prefill(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        with self.cache.free_group():
            for i, req in enumerate(batch.reqs):
                if req.finished() or req.is_retracted:
                    continue
                if i < batch.num_extend_reqs and req.is_chunked > 0:
                    req.is_chunked -= 1  # a middle chunk: its sample is meaningless
                    if req.to_finish is not None:
                        self.retire(req, req.to_finish)
                    else:
                        self.cache.cache_unfinished(req)
                    continue
                self._append(req, result, i)
                if not req.finished():
                    if i < batch.num_extend_reqs:
                        self.cache.cache_unfinished(req)
                    self.pending.append(req)

    def process_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        with self.cache.free_group():
            for i, req in enumerate(batch.reqs):
                if req.finished() or req.is_retracted:
                    continue
                self._append(req, result, i)
                if not req.finished():  # a finished one's last output was queued by retire
                    self.pending.append(req)

    # ---- per request ----------------------------------------------------------------------------
    def _append(self, req: Req, result: GenerationBatchResult, i: int) -> None:
        if req.to_finish is not None:
            self.retire(req, req.to_finish)
            return
        token = result.next_token_ids[i]
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        req.output_ids.append(token)
        # Before the grammar may end the request: its last token has logprobs like every other
        # (and a prefill whose first token ends it still has them to send to decode).
        if result.logprobs is not None:
            req.logprobs.append(result.logprobs[i])
            if result.top_logprobs is not None:
                n = req.sampling_params.top_logprobs_num
                req.top_logprobs.append(result.top_logprobs[i][:n])
        reason = accept_grammar_token(req, token) or self.check_finished(req, token)
        if reason is not None:
            self.retire(req, reason)

    def check_finished(self, req: Req, token: int) -> FinishReason | None:
        sp = req.sampling_params
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            return FinishReason("stop", matched=token)
        if sp.stop:
            if req.detok is None:
                req.detok = IncrementalDetokenizer(self.tokenizer())
                req.detok.step(req.output_ids[:-1])
            delta = req.detok.step([token])
            hit = req.detok.find_stop(len(delta), sp.stop) if delta else None
            if hit is not None:
                return FinishReason("stop", matched=hit[1])
        if len(req.output_ids) >= sp.max_new_tokens:
            return finish_length(sp.max_new_tokens)
        return None

    # ---- output ---------------------------------------------------------------------------------
    def queue(self, req: Req) -> None:
        """Send what `req` has new (and its end, once finished) at the next flush."""
        self.pending.append(req)

    def flush(self) -> None:
        """One output per queued request, in one emit (the scheduler flushes once a step, after
        the role part has seen the results): a request queued twice (its progress,
        then its end in the same step) still gets one output."""
        if not self.pending:
            return
        reqs, self.pending = self.pending, []
        self.emit([self.make_output(r) for r in dict.fromkeys(reqs)])

    @staticmethod
    def make_output(req: Req) -> ReqOutput:
        new = req.output_ids[req.stream_offset :]
        start = req.stream_offset
        req.stream_offset = len(req.output_ids)
        fr = req.finished_reason
        out = ReqOutput(
            rid=req.rid, token_ids=new, finished=fr is not None,
            finish_reason=None if fr is None else {"kind": fr.kind, "matched": fr.matched, "message": fr.message,
                                           "status": fr.status},
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, retract_count=req.retract_count,
            ttft=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
        )
        if req.sampling_params.return_logprob or req.sampling_params.top_logprobs_num:
            out.logprobs = req.logprobs[start:]
            out.top_logprobs = [[[t, lp] for t, lp in row] for row in req.top_logprobs[start:]]
        return out


def accept_grammar_token(req: Req, token: int) -> FinishReason | None:
    """Advance a constrained request's matcher by the token just appended. The mask allowed
    only tokens the grammar accepts, so a refusal means the mask and the matcher disagree:
    that request fails alone. A grammar that has accepted its stop token ends the request."""
    if req.grammar is None:
        return None
    if not req.grammar.accept(token):
        return finish_abort(f"token {token} does not match the request's grammar", status=500)
    if req.grammar.is_terminated():
        return FinishReason("stop", matched=token)
    return None
