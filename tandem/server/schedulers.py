"""The worker's scheduler processes: which PD role part they run, and their early start.

A worker's start is two long import chains: the front's (the web stack, the tokenizer) and each
scheduler process's (torch, transformers, the engine, then the weights). `tandem serve` spawns
the scheduler processes first, before it imports its web stack, so the chains run side by side;
the app's lifespan then waits for them (Front's client_factory is `serve`). The ranks load
nothing in this process: it stays free of torch on CPU machines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.server.config import ServerConfig
from tandem.worker_contract import COLOCATED, DECODE, PREFILL, WORKER_ROLES

ClientFactory = Callable[[Callable[[list[Any]], None]], Any]


def role_attach(role: str) -> Any:
    """The PD role's part for the scheduler (engine/scheduler/role_part.py); None colocated.
    Imported only for its role: a colocated worker never loads NIXL."""
    if role == PREFILL:
        from tandem.prefill.role import attach

        return attach
    if role == DECODE:
        from tandem.decode.role import attach

        return attach
    if role != COLOCATED:
        raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
    return None


def start(config: ServerConfig) -> Any:
    """The ranks, spawned now and loading; `serve(emit)` on the result waits for them."""
    from tandem.engine.dp_controller import DataParallelController

    return DataParallelController(config.engine, config.model_path, attach=role_attach(config.role))


def on_demand(config: ServerConfig) -> ClientFactory:
    """A client factory that spawns the ranks only when the lifespan asks (an app built
    without `tandem serve`'s early start)."""
    return lambda emit: start(config).serve(emit)
