"""What a failure in a batch names, and which failures no one can contain.

A failure while building a batch is raised as `BatchFailed`, carrying the requests the batch
was built from (the ScheduleBatch methods marked @traced add them); batch_faults.py then fails
exactly those. `is_fatal` picks the faults that may have left the device or the pools in a
state no one knows: those end the scheduler instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tandem.engine.scheduler.cache_manager import OutOfKV
from tandem.engine.scheduler.req import Req

T = TypeVar("T")
# Device faults that torch reports as a plain RuntimeError (older builds, NCCL, cuBLAS).
_DEVICE_WORDS = ("CUDA", "CUBLAS", "CUDNN", "NCCL", "DEVICE-SIDE ASSERT")


class BatchFailed(Exception):
    """Building a batch failed; `reqs` are the requests it was being built from."""

    def __init__(self, reqs: list[Req], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.reqs, self.cause = reqs, cause


def is_fatal(exc: BaseException) -> bool:
    """The fault may have left the device or the pools in a state no one knows."""
    if not isinstance(exc, Exception) or isinstance(exc, (MemoryError, AssertionError, OutOfKV)):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).upper() for w in _DEVICE_WORDS)


def traced(method: Callable[..., T]) -> Callable[..., T]:
    """For a ScheduleBatch method: a contained failure names the batch's requests, and those of
    a batch passed in (mix_with_running prepares the running batch and takes its requests)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kw: Any) -> T:
        # The membership before the call, by reference: ScheduleBatch replaces its `reqs` list and
        # never edits it in place, so nothing is copied on the hot path; lists are joined on failure only.
        before = [self.reqs, *(a.reqs for a in args if isinstance(getattr(a, "reqs", None), list))]
        try:
            return method(self, *args, **kw)
        except BatchFailed as exc:
            reqs = [r for group in before for r in group]
            raise BatchFailed(reqs + [r for r in exc.reqs if r not in reqs], exc.cause) from exc.cause
        except Exception as exc:
            if is_fatal(exc):
                raise
            raise BatchFailed([r for group in before for r in group], exc) from exc

    return wrapper
