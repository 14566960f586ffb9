"""The decode role: the colocated scheduler plus a KV receiver (prealloc and transfer queues).
Under tensor parallelism every rank attaches one (a collective: tandem/pd/parts.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.decode.allowlist import Allowlist, parse_peers
from tandem.decode.peers import PrefillPeers
from tandem.decode.receiver import DecodeReceiver
from tandem.pd.parts import transfer_parts
from tandem.worker_contract import DECODE

if TYPE_CHECKING:
    from tandem.engine.scheduler.role_part import Host


def attach(host: Host, model_path: str) -> DecodeReceiver:
    cfg = host.config
    addresses = parse_peers(cfg.pd_prefill_peers)  # a bad entry fails the start-up, before any socket
    parts = transfer_parts(host, model_path, DECODE)
    parts.channel.start()
    peers = PrefillPeers(parts, cfg.pd_bootstrap_timeout, [a.key for a in addresses], lambda: host.now)
    return DecodeReceiver(host, parts.transfer, peers, parts.slots, Allowlist(addresses))
