"""Turn a GenerateReq into a Req, or into a clear error output."""

from __future__ import annotations

from tandem.engine.engine_config import EngineConfig
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.scheduler.req import Req
from tandem.engine.scheduler.sampling_params import SamplingParams
from tandem.protocol.messages import GenerateReq, ReqOutput


def _error(rid: str, message: str, prompt_tokens: int) -> ReqOutput:
    return ReqOutput(
        rid=rid, token_ids=[], finished=True, prompt_tokens=prompt_tokens,
        finish_reason={"kind": "abort", "matched": None, "message": message},
    )


def build_req(msg: GenerateReq, runner: ModelRunner, config: EngineConfig) -> tuple[Req | None, ReqOutput | None]:
    n = len(msg.input_ids)
    try:
        params = SamplingParams.make(**msg.sampling)
    except (TypeError, ValueError) as exc:
        return None, _error(msg.rid, f"invalid sampling parameters: {exc}", n)
    if n == 0:
        return None, _error(msg.rid, "the prompt is empty", 0)
    bad = [t for t in msg.input_ids if not 0 <= t < runner.vocab_size]
    if bad:
        return None, _error(msg.rid, f"token id {bad[0]} is outside the vocabulary [0, {runner.vocab_size})", n)
    limit = runner.max_context_len
    if n + params.max_new_tokens > limit:
        return None, _error(
            msg.rid, f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"context length {limit}", n)
    if n + params.max_new_tokens > runner.kv_pool.capacity_tokens:
        return None, _error(msg.rid, f"request needs more KV ({n + params.max_new_tokens} tokens) than the "
                            f"pool holds ({runner.kv_pool.capacity_tokens})", n)
    return Req(msg.rid, list(msg.input_ids), params, priority=msg.priority), None
