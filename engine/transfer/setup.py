"""What both PD roles set up before their part is attached: the transfer agent (KV
memory registered), the control channel, the identity, and UCX kept inside the KV port
range the operator's NetworkPolicy opens."""

from __future__ import annotations

import os
import uuid
from typing import Any

from tandem.engine.transfer.control import ControlChannel
from tandem.engine.transfer.identity import identity_of
from tandem.protocol import pd
from tandem.worker_contract import DEFAULT_KV_PORT_COUNT, ENV_KV_PORT_BASE, ENV_KV_PORT_COUNT


def confine_ucx_ports(environ: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """UCX's TCP transport listens on random ports; keep them in TANDEM_KV_PORT_BASE's range."""
    if ENV_KV_PORT_BASE in environ and "UCX_TCP_PORT_RANGE" not in environ:
        base = int(environ[ENV_KV_PORT_BASE])
        count = int(environ.get(ENV_KV_PORT_COUNT, DEFAULT_KV_PORT_COUNT))
        environ["UCX_TCP_PORT_RANGE"] = f"{base}-{base + count - 1}"


def transfer_parts(sched: Any, model_path: str, role: str) -> tuple[Any, ControlChannel, pd.Identity]:
    from tandem.engine.transfer.nixl_agent import NixlTransfer

    confine_ucx_ports()
    sched.cache.allocator.sorted_free = True  # consecutive pages: fewer transfer descriptors
    cfg = sched.config
    name = f"{role}-{uuid.uuid4().hex[:8]}-r{sched.dp_rank}"
    transfer = NixlTransfer(name, timeout=cfg.pd_transfer_timeout)
    channel = ControlChannel(name, sched.inbox, cfg.pd_heartbeat_interval, cfg.pd_heartbeat_timeout)
    return transfer, channel, identity_of(sched.runner, model_path)
