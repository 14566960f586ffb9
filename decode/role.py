"""The decode role: the colocated scheduler plus a KV receiver (prealloc and transfer queues)."""

from __future__ import annotations

from typing import Any

from tandem.decode.peers import PrefillPeers
from tandem.decode.receiver import DecodeReceiver
from tandem.engine.transfer.setup import transfer_parts
from tandem.worker_contract import DECODE


def attach(sched: Any, model_path: str) -> DecodeReceiver:
    cfg = sched.config
    parts = transfer_parts(sched, model_path, DECODE)
    parts.channel.start()
    part = DecodeReceiver(sched, parts.transfer, PrefillPeers(parts, cfg.pd_bootstrap_timeout), parts.slots)
    sched.attach(part)
    return part
