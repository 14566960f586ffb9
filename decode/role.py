"""The decode role: the colocated scheduler plus a KV receiver (prealloc and transfer queues)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.decode.allowlist import Allowlist, parse_peers
from tandem.decode.peers import PrefillPeers
from tandem.decode.receiver import DecodeReceiver
from tandem.pd.parts import transfer_parts
from tandem.worker_contract import DECODE

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler


def attach(sched: Scheduler, model_path: str) -> DecodeReceiver:
    cfg = sched.config
    if cfg.tp_size > 1:  # the transfer layer moves head slices (tandem/pd/transfer/head_map.py); the role does not yet
        raise ValueError("a decode worker runs tp_size 1 for now: PD between tensor-parallel workers is not wired yet")
    addresses = parse_peers(cfg.pd_prefill_peers)  # a bad entry fails the start-up, before any socket
    parts = transfer_parts(sched, model_path, DECODE)
    parts.channel.start()
    peers = PrefillPeers(parts, cfg.pd_bootstrap_timeout, [a.key for a in addresses])
    part = DecodeReceiver(sched, parts.transfer, peers, parts.slots, Allowlist(addresses))
    sched.attach(part)
    return part
