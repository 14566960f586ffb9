"""The prefill role: the colocated scheduler plus a KV sender, listening on the bootstrap port."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.pd.parts import transfer_parts
from tandem.prefill.sender import PrefillSender
from tandem.worker_contract import PREFILL

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler


def attach(sched: Scheduler, model_path: str) -> PrefillSender:
    cfg = sched.config
    if cfg.tp_size > 1:  # the transfer layer moves head slices (tandem/pd/transfer/head_map.py); the role does not yet
        raise ValueError("a prefill worker runs tp_size 1 for now: PD between tensor-parallel workers is not wired yet")
    if cfg.dp_size > 1:
        raise ValueError("a prefill worker runs dp_size 1 (scale prefill with more workers)")
    parts = transfer_parts(sched, model_path, PREFILL)
    parts.channel.bind(f"tcp://{cfg.pd_bootstrap_host}:{cfg.pd_bootstrap_port}")
    part = PrefillSender(sched, parts)
    sched.attach(part)
    parts.channel.start()
    return part
