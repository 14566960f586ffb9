"""A transferred request joins decode's running batch as already prefilled, with the first
token prefill sampled (read from its first-token slot by decode/receiver.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from tandem.engine.scheduler.output_processor import accept_grammar_token
from tandem.engine.scheduler.req import Req, ReqStatus
from tandem.engine.scheduler.schedule_batch import ScheduleBatch
from tandem.protocol.logprobs import LOGPROB_FLOOR

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler


def start_decoding(sched: Scheduler, req: Req, token: int, logprob: float | None, top: list) -> None:
    req.first_token_time = req.last_token_time = time.monotonic()
    req.output_ids.append(token)
    req.status = ReqStatus.DECODING
    if req.sampling_params.return_logprob or req.sampling_params.top_logprobs_num:
        # None: prefill was not asked for logprobs (a router that sent the two roles different
        # bodies). The floor, never NaN: every number a route emits is finite.
        req.logprobs.append(logprob if logprob is not None else LOGPROB_FLOOR)
        req.top_logprobs.append(top[: req.sampling_params.top_logprobs_num])
    # Prefill sampled the first token under the same grammar; decode's matcher, built from the
    # same constraint, catches up on it here and continues from it.
    reason = req.to_finish or accept_grammar_token(req, token) or sched.output.check_finished(req, token)
    if reason is not None:
        sched.output.finish(req, reason)
        sched.reqs.pop(req.rid, None)
    else:
        ids = np.array([token], dtype=np.int64)
        sched.decode.running_batch.merge_batch(ScheduleBatch([req], output_ids=ids))
    sched.output.stream([req])
