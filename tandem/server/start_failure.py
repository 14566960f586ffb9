"""A worker's fatal start-up error, written where Kubernetes reads the container's termination message.

A worker that cannot start (a tp_size the model's heads refuse, a bad engine option, weights that
do not load) exits, and Kubernetes restarts it: a crash loop whose reason sits in the logs only.
The operator renders TANDEM_TERMINATION_MESSAGE_PATH (tandem/worker_contract.py) beside
terminationMessagePath, so the error written here lands in the pod's
`lastState.terminated.message`, and the operator shows it as the InferenceService's
WorkersFailing condition. Without that env (`tandem serve` by hand, `tandem up`, tests)
nothing is written. Torch-free: the error may be that torch would not import.

Start-up fails in two places: reading the config (cli.py, `reported_start_failure`) and loading
the model in the app's lifespan (app.py, `reporting_lifespan`), where uvicorn would otherwise
log the error and swallow it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from tandem.worker_contract import ENV_TERMINATION_MESSAGE_PATH, TERMINATION_MESSAGE_MAX_BYTES

log = logging.getLogger("tandem.server")
ELLIPSIS = "…"


def describe(exc: BaseException) -> str:
    return f"start-up failed: {type(exc).__name__}: {exc}"


def bounded(message: str, limit: int = TERMINATION_MESSAGE_MAX_BYTES) -> bytes:
    """`message` as UTF-8 within `limit` bytes: the head (the error's first words say what it
    is), cut on a character boundary and marked with an ellipsis."""
    data = message.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return data
    mark = ELLIPSIS.encode()
    return data[: limit - len(mark)].decode("utf-8", errors="ignore").encode() + mark


def write_start_failure(message: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Write `message` (bounded) to the termination-message file the env names; False when
    none is named or it cannot be written. Never raises: the error being reported matters more."""
    path = environ.get(ENV_TERMINATION_MESSAGE_PATH)
    if not path:
        return False
    try:
        with open(path, "wb") as f:
            f.write(bounded(message))
    except OSError as exc:
        log.warning("could not write the start-up error to %s: %s", path, exc)
        return False
    return True


@contextlib.contextmanager
def reported_start_failure(environ: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Record an exception (or a SystemExit that carries a message) raised inside, then re-raise it."""
    try:
        yield
    except SystemExit as exc:
        if isinstance(exc.code, str):  # argparse-style `raise SystemExit("--config x: no such file")`
            write_start_failure(f"start-up failed: {exc.code}", environ)
        raise
    except Exception as exc:
        write_start_failure(describe(exc), environ)
        raise


Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


def reporting_lifespan(lifespan: Lifespan, environ: Mapping[str, str] = os.environ) -> Lifespan:
    """`lifespan`, recording an exception raised before it yields (the model load), not after."""

    @contextlib.asynccontextmanager
    async def wrapped(app: Any) -> AsyncIterator[None]:
        started = False
        try:
            async with lifespan(app):
                started = True
                yield
        except Exception as exc:
            if not started:
                write_start_failure(describe(exc), environ)
            raise

    return wrapped
