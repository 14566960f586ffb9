"""The offline Engine: `Engine(model=DIR, **config).generate(prompts, sampling_params)`.

It runs the same Scheduler the servers run: in a background thread of this
process for dp_size 1, or in dp_size scheduler processes behind the DP
controller. Requests go in as GenerateReq; ReqOutput deltas come back and
are routed to each request's RequestHandle (`submit`), which `generate`
drains and `generate_stream` yields from. `status`, `error` and `scheduler`
let tests and tools see the scheduler's state without reaching into it.
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
from tandem.engine.request_handle import RequestHandle
from tandem.protocol.messages import AbortReq, AdminResult, FlushCacheReq, GenerateReq, ReqOutput, StatusReq

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
        self._routes: dict[str, queue.SimpleQueue] = {}  # rid -> its RequestHandle's outputs
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        if self.config.dp_size > 1 or self.config.tp_size > 1:
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

    def _route(self, rid: str, prompt_ids: list[int]) -> RequestHandle:
        self._check_open()
        handle = RequestHandle(rid, prompt_ids, lambda: self._backend.error, self._drop_route, self.abort)
        with self._lock:
            self._routes[rid] = handle.outputs
        return handle

    def _drop_route(self, rid: str) -> None:
        with self._lock:
            self._routes.pop(rid, None)

    def _check_open(self) -> None:
        # After shutdown nothing reads the inbox: a request would wait forever.
        if self._closed:
            raise RuntimeError("the engine was shut down")

    # ---- public API --------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: dict[str, Any] | None = None,
               priority: int = 0) -> RequestHandle:
        """Send one request and return its handle, to read its outputs as they come
        (`next`, `result`), abort or close it. `generate` and `generate_stream` use it."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        handle = self._route(f"{next(self._ids)}-{uuid.uuid4().hex[:8]}", ids)
        self._backend.send(GenerateReq(handle.rid, ids, dict(sampling_params or {}), priority))
        return handle

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: dict | Sequence[dict] | None = None
    ) -> list[dict[str, Any]]:
        """Per prompt: {"text", "token_ids", "finish_reason", "meta"}. Texts or token-id lists."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or {}] * len(plist)
        if len(params) != len(plist):
            raise ValueError("one sampling_params per prompt, or one for all")
        pending = [self.submit(p, sp) for p, sp in zip(plist, params)]
        results = []
        for handle, sp in zip(pending, params):
            tokens: list[int] = []
            last: ReqOutput | None = None
            logprobs: list[float] = []
            with handle:
                while last is None or not last.finished:
                    last = handle.next()
                    tokens += last.token_ids
                    logprobs += last.logprobs or []
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
        handle = self.submit(prompt, sp)
        finished = False
        try:
            while not finished:
                out: ReqOutput = handle.next()
                finished = out.finished
                yield {"text": stream.feed(out.token_ids, finished), "token_ids": out.token_ids,
                       "finished": finished, "finish_reason": (out.finish_reason or {}).get("kind")}
        finally:
            if not finished:  # the consumer stopped early: free the request's KV now
                handle.abort()
            handle.close()

    def abort(self, rid: str) -> None:
        if not self._closed:  # after shutdown there is nothing left to abort
            self._backend.send(AbortReq(rid))

    def flush_cache(self) -> list[AdminResult]:
        """Drop the prefix caches (when idle) and check every pool is whole again."""
        return self._admin(FlushCacheReq, "flush")

    def status(self) -> list[AdminResult]:
        """Per scheduler: load and KV-pool state (admin.pool_state); when idle, the pool's
        integrity check runs first (it raises in the scheduler if a page leaked)."""
        return self._admin(StatusReq, "status")

    def _admin(self, command: type, name: str) -> list[AdminResult]:
        """One admin command, answered once by every scheduler."""
        with self._route(f"{name}-{uuid.uuid4().hex[:8]}", []) as handle:
            self._backend.send(command(handle.rid))
            return [handle.next(timeout=60) for _ in range(self.config.dp_size)]

    @property
    def closed(self) -> bool:
        """Whether `shutdown` ran: the engine takes no more requests."""
        return self._closed

    @property
    def error(self) -> BaseException | None:
        """Why the scheduler stopped; None while it runs."""
        return self._backend.error

    @property
    def backend(self) -> SchedulerClient:
        """The scheduler client: an InProcessScheduler (dp_size 1) or the DP controller."""
        return self._backend

    @property
    def scheduler(self) -> Any:
        """The in-process Scheduler (dp_size 1), for tests and tools that read its state or
        instrument its loop (untyped: its insides are engine/scheduler/'s own, no API). DP
        ranks run in their own processes, out of reach."""
        sched = getattr(self._backend, "scheduler", None)
        if sched is None:
            raise RuntimeError("no in-process scheduler: dp_size > 1, or the engine was shut down")
        return sched

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
