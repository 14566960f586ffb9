"""The decode role: the colocated scheduler plus a KV receiver (prealloc and transfer queues)."""

from __future__ import annotations

from typing import Any

from tandem.decode.peers import PrefillPeers, make_hello
from tandem.decode.receiver import DecodeReceiver
from tandem.engine.transfer.first_token import FirstTokenSlots
from tandem.engine.transfer.setup import transfer_parts
from tandem.worker_contract import DECODE


def attach(sched: Any, model_path: str) -> DecodeReceiver:
    cfg = sched.config
    transfer, channel, identity = transfer_parts(sched, model_path, DECODE)
    layout = sched.runner.kv_pool.layout()
    slots = FirstTokenSlots(cfg.max_running_requests)
    meta = transfer.register(layout, slots.region())
    hello = make_hello(transfer.name, identity, layout, meta, slots.region())
    channel.start()
    peers = PrefillPeers(channel, transfer, hello, identity, cfg.pd_bootstrap_timeout)
    part = DecodeReceiver(sched, transfer, peers, slots)
    sched.attach(part)
    return part
