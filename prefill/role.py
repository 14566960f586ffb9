"""The prefill role: the colocated scheduler plus a KV sender, listening on the bootstrap port
(TP rank 0's; under tensor parallelism every rank attaches one, a collective: tandem/pd/parts.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.pd.parts import transfer_parts
from tandem.prefill.sender import PrefillSender
from tandem.worker_contract import PREFILL

if TYPE_CHECKING:
    from tandem.engine.scheduler.role_part import Host


def attach(host: Host, model_path: str) -> PrefillSender:
    cfg = host.config
    if cfg.dp_size > 1:
        raise ValueError("a prefill worker runs dp_size 1 (scale prefill with more workers)")
    parts = transfer_parts(host, model_path, PREFILL)
    parts.channel.bind(f"tcp://{cfg.pd_bootstrap_host}:{cfg.pd_bootstrap_port}")
    part = PrefillSender(host, parts)
    # Its messages wait in the inbox until the scheduler, with the part attached, runs.
    parts.channel.start()
    return part
