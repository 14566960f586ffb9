"""What both PD roles set up before their part is attached, and the handshake's two halves
they share: the transfer agent with the KV buffer and first-token slots registered, the
control channel, the identity, and UCX kept inside the KV port range the operator's
NetworkPolicy opens."""

from __future__ import annotations

import base64
import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.pd import protocol as pd
from tandem.pd.control.channel import ControlChannel
from tandem.pd.identity import identity_of
from tandem.pd.transfer.contract import KVTransfer, TransferError
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.protocol.kv_layout import KVLayout
from tandem.worker_contract import DEFAULT_KV_PORT_COUNT, ENV_KV_PORT_BASE, ENV_KV_PORT_COUNT, ENV_PD_SECRET

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler


def confine_ucx_ports(environ: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """UCX's TCP transport listens on random ports; keep them in TANDEM_KV_PORT_BASE's range."""
    if ENV_KV_PORT_BASE in environ and "UCX_TCP_PORT_RANGE" not in environ:
        base = int(environ[ENV_KV_PORT_BASE])
        count = int(environ.get(ENV_KV_PORT_COUNT, DEFAULT_KV_PORT_COUNT))
        environ["UCX_TCP_PORT_RANGE"] = f"{base}-{base + count - 1}"


@dataclass
class TransferParts:
    transfer: KVTransfer
    channel: ControlChannel
    identity: pd.Identity
    layout: KVLayout
    slots: FirstTokenSlots
    agent_meta: bytes

    @property
    def name(self) -> str:
        return self.transfer.name

    def describe(self) -> dict[str, Any]:
        """This side's half of the handshake (the body of Hello and of an accepting Welcome)."""
        return {"identity": dataclasses.asdict(self.identity), "layout": self.layout.to_dict(),
                "agent": base64.b64encode(self.agent_meta).decode(), "meta": dataclasses.asdict(self.slots.region())}

    def add_peer(self, msg: pd.Hello | pd.Welcome) -> tuple[str | None, list[str]]:
        """Take the other side's half (checked by pd.decode already): (its transfer agent's
        name, []) or (None, the problems as "field: detail", for this side's log; refused()
        says what the peer may be told)."""
        problems = self.identity.mismatch(pd.Identity(**msg.identity))
        if problems:
            return None, problems
        try:
            agent = base64.b64decode(msg.agent, validate=True)
        except ValueError:
            return None, ["agent: not base64"]
        try:
            return self.transfer.add_peer(agent, KVLayout(**msg.layout), pd.MetaRegion(**msg.meta)), []
        except TransferError as exc:  # the transfer engine refused the metadata
            return None, [f"agent: {exc}"]
        except ValueError as exc:  # KVLayout.mismatch
            return None, [f"layout: {exc}"]


def refused(problems: list[str], detail: bool) -> str:
    """The handshake error: with detail for this side's log and its own requests; without, what
    a refusal tells the peer: the fields that differ, never this side's values (addresses,
    agent metadata)."""
    if detail:
        return "PD handshake refused: " + "; ".join(problems)
    return "PD handshake refused: mismatch in " + ", ".join(p.split(":", 1)[0] for p in problems)


def transfer_parts(sched: Scheduler, model_path: str, role: str) -> TransferParts:
    from tandem.pd.transfer.nixl_agent import NixlTransfer

    confine_ucx_ports()
    cfg = sched.config
    name = f"{role}-{uuid.uuid4().hex[:8]}-r{sched.dp_rank}"
    transfer = NixlTransfer(name, timeout=cfg.pd_transfer_timeout)
    # From the env only: a flag would show in `ps`, an engine option in /get_server_info.
    secret = os.environ.get(ENV_PD_SECRET) or None
    channel = ControlChannel(name, sched.inbox, cfg.pd_heartbeat_interval, cfg.pd_heartbeat_timeout, secret)
    layout = sched.runner.kv_pool.layout()
    slots = FirstTokenSlots(cfg.max_running_requests, device=sched.runner.kv_pool.kv_buffer.device)
    meta = transfer.register(layout, slots.region())
    return TransferParts(transfer, channel, identity_of(sched.runner, model_path), layout, slots, meta)
