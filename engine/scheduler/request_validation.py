"""Turn a GenerateReq into a Req, or into a clear error output.

Everything a batch builds from a request is checked here, before the request can join one:
a value that failed inside a forward would fail every request batched with it
(batch_faults.py), so hostile input is refused alone, up front.
"""

from __future__ import annotations

import dataclasses
import operator

from tandem.engine.engine_config import EngineConfig
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.sampling_params import DETERMINISTIC_SEED, SamplingParams
from tandem.engine.scheduler.req import Req
from tandem.protocol import limits as L
from tandem.protocol.messages import GenerateReq, ReqOutput


def _error(rid: str, message: str, prompt_tokens: int) -> ReqOutput:
    return ReqOutput(
        rid=rid, token_ids=[], finished=True, prompt_tokens=prompt_tokens,
        finish_reason={"kind": "abort", "matched": None, "message": message},
    )


def build_req(msg: GenerateReq, runner: ModelRunner, config: EngineConfig,
              in_use: bool = False) -> tuple[Req | None, ReqOutput | None]:
    """`in_use`: a request with this rid is still running. A front names every request
    uniquely; a repeat would share the other's bookkeeping (and its outputs' key)."""
    n = len(msg.input_ids) if isinstance(msg.input_ids, list) else 0
    if in_use:
        return None, _error(msg.rid, f"request id {msg.rid!r} is already in use", n)
    sampling = msg.sampling
    if config.deterministic and "seed" not in sampling:  # else a random seed: another draw every time
        sampling = {**sampling, "seed": DETERMINISTIC_SEED}
    try:
        params = SamplingParams.make(**sampling)
    except (TypeError, ValueError) as exc:
        return None, _error(msg.rid, f"invalid sampling parameters: {exc}", n)
    try:
        return _build(msg, params, runner), None
    except (TypeError, ValueError) as exc:
        return None, _error(msg.rid, str(exc), n)


def _build(msg: GenerateReq, params: SamplingParams, runner: ModelRunner) -> Req:
    ids, vocab = msg.input_ids, runner.vocab_size
    if not isinstance(ids, list) or not ids:
        raise ValueError("the prompt is empty")
    if set(map(type, ids)) != {int}:  # JSON and tokenizers give ints; numpy ints convert, floats do not
        ids = [operator.index(t) for t in ids]
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    if not isinstance(msg.priority, int) or not -L.INT32_MAX <= msg.priority <= L.INT32_MAX:
        raise ValueError(f"priority must be an int32, got {msg.priority!r}")
    n, limit = len(ids), runner.max_context_len
    if n + params.max_new_tokens > limit:
        raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                         f"context length {limit}")
    if n + params.max_new_tokens > runner.kv_pool.capacity_tokens:
        raise ValueError(f"request needs more KV ({n + params.max_new_tokens} tokens) than the "
                         f"pool holds ({runner.kv_pool.capacity_tokens})")
    if params.top_logprobs_num > vocab:
        raise ValueError(f"top_logprobs_num ({params.top_logprobs_num}) exceeds the vocabulary ({vocab})")
    if params.top_k >= vocab:  # the same draw, without a sort the sampler would do for nothing
        params = dataclasses.replace(params, top_k=-1)
    return Req(msg.rid, list(ids), params, priority=msg.priority)
