"""The offline Engine: `Engine(model=DIR, **config).generate(prompts, sampling_params)`.

It runs the same Scheduler the servers run: in a background thread of this
process for dp_size 1, or in dp_size scheduler processes behind the DP
controller. Requests go in as GenerateReq; ReqOutput deltas come back and
are routed to per-request queues, which `generate` drains and
`generate_stream` yields from.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from tandem.engine.detokenizer import TextStream
from tandem.engine.engine_config import EngineConfig
from tandem.engine.launch import InProcessScheduler, SchedulerClient
from tandem.protocol.messages import AbortReq, AdminResult, FlushCacheReq, GenerateReq, ReqOutput

Prompt = str | list[int]

# The engines not yet shut down. Weak: atexit once held a bound `shutdown` per Engine, which
# kept every Engine, its model and its KV memory alive until the process exited.
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _shutdown_live_engines() -> None:
    """At exit: stop the engines still alive (their scheduler threads and processes)."""
    for engine in list(_live_engines):
        engine.shutdown()


class Engine:
    def __init__(self, model: str = "tiny", **config: Any) -> None:
        from transformers import AutoTokenizer

        from tandem.engine.modelgen.resolve import resolve_model

        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.model_path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self._routes: dict[str, queue.SimpleQueue] = {}  # per request; SimpleQueue: put is C, no Condition
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        if self.config.dp_size > 1:
            from tandem.engine.dp_controller import DataParallelController

            self._backend: SchedulerClient = DataParallelController(
                self.config, str(self.model_path), self._on_outputs)
        else:
            self._backend = InProcessScheduler(self.config, str(self.model_path), self._on_outputs)
        _live_engines.add(self)
        # Registered again on each Engine so it runs before the exit handlers registered
        # since (atexit is LIFO), as a per-engine registration did: multiprocessing's would
        # otherwise terminate the DP ranks before they are asked to stop.
        atexit.unregister(_shutdown_live_engines)
        atexit.register(_shutdown_live_engines)

    # ---- plumbing ----------------------------------------------------------------------------
    def _on_outputs(self, outs: list[Any]) -> None:
        with self._lock:  # once per batch of outputs, not per request
            routes = [(self._routes.get(o.rid), o) for o in outs]
        for q, o in routes:
            if q is not None:
                q.put(o)

    def _submit(
        self, prompt: Prompt, params: dict[str, Any], priority: int = 0
    ) -> tuple[str, queue.SimpleQueue, list[int]]:
        self._check_open()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._routes[rid] = q
        self._backend.send(GenerateReq(rid, ids, dict(params), priority))
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

    def _check_open(self) -> None:
        # After shutdown nothing reads the inbox: a request would wait forever.
        if self._closed:
            raise RuntimeError("the engine was shut down")

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
        # The streaming detokenizer's final text, so offline and served text agree (a character
        # cut off by max_tokens is left out, never a trailing U+FFFD).
        text = TextStream(self.tokenizer).feed(tokens, finished=True)
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
        stream = TextStream(self.tokenizer, tuple([sp["stop"]] if isinstance(sp.get("stop"), str)
                                                  else sp.get("stop") or ()))
        rid, q, _ = self._submit(prompt, sp)
        finished = False
        try:
            while not finished:
                out: ReqOutput = self._get(q)
                finished = out.finished
                yield {"text": stream.feed(out.token_ids, finished), "token_ids": out.token_ids,
                       "finished": finished, "finish_reason": (out.finish_reason or {}).get("kind")}
        finally:
            if not finished:  # the consumer stopped early: free the request's KV now
                self.abort(rid)
            self._close(rid)

    def abort(self, rid: str) -> None:
        if not self._closed:  # after shutdown there is nothing left to abort
            self._backend.send(AbortReq(rid))

    def flush_cache(self) -> list[AdminResult]:
        """Drop the prefix caches (when idle) and check every pool is whole again."""
        self._check_open()
        rid = f"flush-{uuid.uuid4().hex[:8]}"
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._routes[rid] = q
        self._backend.send(FlushCacheReq(rid))
        replies = [self._get(q, timeout=60) for _ in range(self.config.dp_size)]
        self._close(rid)
        return replies

    def shutdown(self) -> None:
        """Stop the scheduler(s) and release the model and KV memory, even while this Engine
        is still referenced. Safe to call again (explicitly, from `with`, from atexit)."""
        if self._closed:
            return
        self._closed = True
        _live_engines.discard(self)
        self._backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
