"""Worker containers that fail, read off pod status, for the WorkersFailing condition. Pure.

A worker that cannot start (say a tensorParallelSize the model's heads refuse, where the operator
could not check it: tensor_parallel.py) writes its error to the container's termination message
(tandem/server/start_failure.py; a crash that wrote none leaves its log's tail, by
FallbackToLogsOnError). Kubernetes keeps it as `lastState.terminated.message` while the pod crash
loops; this module turns that into a condition, so the CR says why instead of a pod restarting
in silence.

Pod status is hostile input: a worker writes its termination message, and whatever it ran (a
model's code, a template's command where the policy allows one) may write anything. So every
field is type-checked, text is reduced to printable characters and clipped, and the condition
names a few containers, not every one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator import names
from tandem.operator.conditions import Condition

# Waiting reasons that mean a pod will not come up by itself.
STUCK_WAITING = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                 "InvalidImageName", "CreateContainerError")
EXITED = "ExitedWithError"  # terminated with a non-zero code, not yet backing off
RESTARTING = "RestartingAfterError"  # running again, not ready, after a failed run
MESSAGE_CHARS = 1024  # per container, of its termination message
REPORTED = 3  # containers named in the condition's message


@dataclass(frozen=True)
class WorkerFailure:
    pod: str
    role: str
    reason: str  # one of STUCK_WAITING, EXITED, RESTARTING: never a string from the pod
    restarts: int
    exit_code: int | None
    exit_reason: str  # kubelet's word for the exit (Error, OOMKilled), sanitised
    message: str  # the termination message (or the waiting message), sanitised and clipped

    def describe(self) -> str:
        text = f"pod {self.pod} ({self.role}): {self.reason}, {self.restarts} restarts"
        if self.exit_code is not None:
            text += f", exit code {self.exit_code}" + (f" ({self.exit_reason})" if self.exit_reason else "")
        return f"{text}: {self.message}" if self.message else text


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def clean(value: Any, limit: int) -> str:
    """Printable text on one line ("|" between lines), at most `limit` chars: the head says what
    failed, the tail (a traceback's last line) why, so a clip keeps both ends."""
    if not isinstance(value, str):
        return ""
    lines = ("".join(ch if ch.isprintable() else " " for ch in line).strip() for line in value.splitlines())
    text = " | ".join(line for line in lines if line)
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]} … {text[len(text) - (limit - 3 - half):]}"


def _word(value: Any) -> str:
    """A kubelet reason such as OOMKilled, or "" for anything that is not one short word."""
    return value if isinstance(value, str) and value.isascii() and value.isalnum() and len(value) <= 32 else ""


def _failure(pod: str, role: str, cs: dict[str, Any]) -> WorkerFailure | None:
    state, last = _dict(cs.get("state")), _dict(_dict(cs.get("lastState")).get("terminated"))
    waiting, terminated = _dict(state.get("waiting")), _dict(state.get("terminated"))
    restarts = max(_count(cs.get("restartCount")) or 0, 0)
    if waiting.get("reason") in STUCK_WAITING:
        reason, ended = str(waiting["reason"]), terminated or last
    elif terminated and _count(terminated.get("exitCode")) not in (None, 0):
        reason, ended = EXITED, terminated
    elif (state.get("running") is not None and cs.get("ready") is not True and restarts > 0
          and _count(last.get("exitCode")) not in (None, 0)):
        reason, ended = RESTARTING, last
    else:
        return None
    # A container that ran says why it ended; one that never ran (an image pull) has the kubelet's word.
    message = ended.get("message") if ended else waiting.get("message")
    return WorkerFailure(pod, role, reason, restarts, _count(ended.get("exitCode")), _word(ended.get("reason")),
                         clean(message, MESSAGE_CHARS))


def worker_failures(pods: list[Any]) -> tuple[WorkerFailure, ...]:
    """The failing worker containers (the container named after the pod's role; a mesh sidecar's
    trouble is not the worker's) of these pods, those with a message first."""
    out = []
    for pod in pods if isinstance(pods, list) else []:
        meta = _dict(_dict(pod).get("metadata"))
        role = _dict(meta.get("labels")).get(names.LABEL_COMPONENT)
        if role not in names.WORKER_ROLES:
            continue
        name = clean(meta.get("name"), 253)
        statuses = _dict(_dict(pod).get("status")).get("containerStatuses")
        for cs in statuses if isinstance(statuses, list) else []:
            if isinstance(cs, dict) and cs.get("name") == role:
                failure = _failure(name, role, cs)
                if failure is not None:
                    out.append(failure)
    return tuple(sorted(out, key=lambda f: (not f.message, f.pod)))


def workers_failing(failures: tuple[WorkerFailure, ...]) -> Condition:
    if not failures:
        return Condition("WorkersFailing", "False", "NoFailures", "")
    parts = [f.describe() for f in failures[:REPORTED]]
    if len(failures) > REPORTED:
        parts.append(f"and {len(failures) - REPORTED} more failing worker containers")
    return Condition("WorkersFailing", "True", failures[0].reason, "; ".join(parts))
