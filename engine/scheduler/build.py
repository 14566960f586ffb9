"""The one place a Scheduler is constructed and its role part attached (engine/launch.py loads
the model and calls this), so nothing outside engine/scheduler/ names the concrete class."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from tandem.engine.engine_config import EngineConfig
from tandem.engine.kvcache.kv_memory import KVMemory
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.scheduler.role_part import AttachRole
from tandem.engine.scheduler.scheduler import Scheduler
from tandem.protocol.messages import ReqOutput


def build_scheduler(config: EngineConfig, runner: ModelRunner, memory: KVMemory,
                    inbox: queue.Queue | queue.SimpleQueue, emit: Callable[[list[ReqOutput]], None],
                    tokenizer: Callable[[], Any], dp_rank: int = 0, model_path: str = "",
                    attach: AttachRole | None = None) -> Scheduler:
    sched = Scheduler(config, runner, memory, inbox, emit, tokenizer, dp_rank=dp_rank)
    if attach is not None:
        sched.attach(attach(sched.life, model_path))
    return sched
