"""RequestHandle: one request submitted to the offline Engine, read output by output.

    handle = engine.submit(prompt_ids, sampling_params)
    out = handle.next(timeout=60)       # the next ReqOutput delta, in order
    tokens, last = handle.result()      # or every token until it finishes
    handle.abort(); handle.close()      # stop it early; stop routing its outputs

`generate` and `generate_stream` are built on it; tests use it to hold several requests
open at once (aborts, priorities, a batch that fails) and read each at their own pace.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from tandem.protocol.messages import ReqOutput

# How often a wait on the queue wakes to ask whether the scheduler died: a dead loop never
# answers, and the caller must learn why rather than hang.
_POLL_S = 0.5


class RequestHandle:
    def __init__(self, rid: str, prompt_ids: list[int], error: Callable[[], BaseException | None],
                 on_close: Callable[[str], None], on_abort: Callable[[str], None]) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # SimpleQueue: put is C, no Condition
        self._error = error
        self._on_close = on_close
        self._on_abort = on_abort

    def next(self, timeout: float | None = None) -> Any:
        """The next output (a ReqOutput; an AdminResult for an admin command). Raises
        RuntimeError if the scheduler stopped, TimeoutError when `timeout` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            try:
                return self.outputs.get(timeout=wait)
            except queue.Empty:
                err = self._error()
                if err is not None:
                    raise RuntimeError(f"the scheduler stopped: {err!r}") from err
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer from the scheduler for {self.rid}") from None

    def result(self, timeout: float | None = None) -> tuple[list[int], ReqOutput]:
        """Every token until the request finishes, and its last output; then closes the
        handle. `timeout` bounds the wait for each output, not the whole request."""
        tokens: list[int] = []
        last: ReqOutput = self.next(timeout)
        tokens += last.token_ids
        while not last.finished:
            last = self.next(timeout)
            tokens += last.token_ids
        self.close()
        return tokens, last

    def abort(self) -> None:
        """Ask the scheduler to finish the request now; its last output says abort."""
        self._on_abort(self.rid)

    def close(self) -> None:
        """Stop routing the request's outputs here (it is not aborted: see abort)."""
        self._on_close(self.rid)

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
