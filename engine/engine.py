"""The offline Engine: `Engine(model=DIR, **config).generate(prompts, sampling_params)`.

It runs the same Scheduler the servers run: in a background thread of this
process for dp_size 1, or in dp_size scheduler processes behind the DP
controller. Requests go in as GenerateReqInput; ReqOutput deltas come back and
are routed to per-request queues, which `generate` drains and
`generate_stream` yields from.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop, stream_holdback
from tandem.engine.engine_config import EngineConfig
from tandem.engine.io_struct import (
    AbortReq,
    AdminResult,
    FlushCacheReq,
    GenerateReqInput,
    ReqOutput,
    ShutdownReq,
)

Prompt = str | list[int]


class Engine:
    def __init__(self, model: str = "tiny", **config: Any) -> None:
        from transformers import AutoTokenizer

        from tandem.engine.model_builder import resolve_model

        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.model_path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self._routes: dict[str, queue.SimpleQueue] = {}  # per request; SimpleQueue: put is C, no Condition
        self._lock = threading.Lock()
        self._ids = itertools.count()
        if self.config.dp_size > 1:
            from tandem.engine.dp_controller import DataParallelController

            self._backend: Any = DataParallelController(self.config, str(self.model_path), self._on_outputs)
        else:
            self._backend = _InProcessScheduler(self.config, str(self.model_path), self.tokenizer, self._on_outputs)
        atexit.register(self.shutdown)

    # ---- plumbing ----------------------------------------------------------------------------
    def _on_outputs(self, outs: list[Any]) -> None:
        with self._lock:  # once per batch of outputs, not per request
            routes = [(self._routes.get(o.rid if isinstance(o, ReqOutput) else o.request_id), o) for o in outs]
        for q, o in routes:
            if q is not None:
                q.put(o)

    def _submit(
        self, prompt: Prompt, params: dict[str, Any], priority: int = 0
    ) -> tuple[str, queue.SimpleQueue, list[int]]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._routes[rid] = q
        self._backend.send(GenerateReqInput(rid, ids, dict(params), priority))
        return rid, q, ids

    def _get(self, q: queue.SimpleQueue, timeout: float | None = None) -> Any:
        """Next output for a request; raises if the scheduler died instead of hanging."""
        waited = 0.0
        while True:
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
                err = self._backend.error
                if err is not None:
                    raise RuntimeError(f"the scheduler stopped: {err!r}") from err
                if timeout is not None and waited >= timeout:
                    raise TimeoutError("no answer from the scheduler") from None

    def _close(self, rid: str) -> None:
        with self._lock:
            self._routes.pop(rid, None)

    # ---- public API --------------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: dict | Sequence[dict] | None = None
    ) -> list[dict[str, Any]]:
        """Per prompt: {"text", "token_ids", "finish_reason", "meta"}. Texts or token-id lists."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or {}] * len(plist)
        if len(params) != len(plist):
            raise ValueError("one sampling_params per prompt, or one for all")
        pending = [self._submit(p, sp) for p, sp in zip(plist, params)]
        results = []
        for (rid, q, _), sp in zip(pending, params):
            tokens: list[int] = []
            last: ReqOutput | None = None
            logprobs: list[float] = []
            while last is None or not last.finished:
                last = self._get(q)
                tokens += last.token_ids
                logprobs += last.logprobs or []
            self._close(rid)
            results.append(self._result(tokens, last, sp or {}, logprobs))
        return results

    def _result(self, tokens: list[int], last: ReqOutput, sp: dict, logprobs: list[float]) -> dict[str, Any]:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        reason = last.finish_reason or {}
        if isinstance(reason.get("matched"), str):
            text = text[: text.find(reason["matched"])] if reason["matched"] in text else text
        meta = {
            "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "cached_tokens": last.cached_tokens, "ttft": last.ttft, "finish_message": reason.get("message"),
            "matched_stop": reason.get("matched"), "retract_count": last.retract_count,
        }
        if sp.get("return_logprob") or sp.get("top_logprobs_num"):
            meta["logprobs"] = logprobs
        return {"text": text, "token_ids": tokens, "finish_reason": reason.get("kind"), "meta": meta}

    def generate_stream(self, prompt: Prompt, sampling_params: dict | None = None) -> Iterator[dict[str, Any]]:
        """Yield {"text": delta, "token_ids": new ids, "finished", "finish_reason"} as tokens arrive.
        Text that could begin a stop string is held back until it cannot."""
        sp = sampling_params or {}
        stops = tuple([sp["stop"]] if isinstance(sp.get("stop"), str) else sp.get("stop") or ())
        hold = stream_holdback(stops)
        rid, q, _ = self._submit(prompt, sp)
        detok = IncrementalDetokenizer(self.tokenizer)
        sent, finished = 0, False
        try:
            while not finished:
                out: ReqOutput = self._get(q)
                finished = out.finished
                detok.step(out.token_ids)
                text = detok.text
                hit = find_stop(text, len(text), stops) if stops else None
                if hit is not None:
                    text = text[: hit[0]]
                end = len(text) if finished or hit else max(len(text) - hold, sent)
                yield {"text": text[sent:end], "token_ids": out.token_ids, "finished": finished,
                       "finish_reason": (out.finish_reason or {}).get("kind")}
                sent = end
        finally:
            if not finished:  # the consumer stopped early: free the request's KV now
                self.abort(rid)
            self._close(rid)

    def abort(self, rid: str) -> None:
        self._backend.send(AbortReq(rid))

    def flush_cache(self) -> list[AdminResult]:
        """Drop the prefix caches (when idle) and check every pool is whole again."""
        rid = f"flush-{uuid.uuid4().hex[:8]}"
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._routes[rid] = q
        self._backend.send(FlushCacheReq(rid))
        replies = [self._get(q, timeout=60) for _ in range(self.config.dp_size)]
        self._close(rid)
        return replies

    def shutdown(self) -> None:
        self._backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _InProcessScheduler:
    """dp_size == 1: the scheduler loop on a thread of this process."""

    def __init__(self, config: EngineConfig, model_path: str, tokenizer: Any, emit: Any) -> None:
        from tandem.engine.model_runner import ModelRunner
        from tandem.engine.scheduler import Scheduler

        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        runner = ModelRunner(model_path, config.runner_config())
        self.scheduler = Scheduler(config, runner, self.inbox, emit, lambda: tokenizer)
        self.thread = threading.Thread(target=self._run, name="tandem-scheduler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.scheduler.run()
        except BaseException as exc:  # surfaced to callers by Engine._get
            self.error = exc
            raise

    def send(self, msg: Any) -> None:
        self.inbox.put(msg)

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.inbox.put(ShutdownReq())
            self.thread.join(timeout=30)
