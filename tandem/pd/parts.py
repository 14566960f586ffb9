"""What both PD roles set up before their part is attached, and the handshake's two halves
they share: the transfer agent with the KV buffer and first-token slots registered, the
control channel, the identity, and UCX kept inside the KV port range the operator's
NetworkPolicy opens.

Tensor parallelism: every TP rank is its own transfer agent with its own KV shard; rank 0
alone runs the control channel (the others a FollowerChannel) and speaks for all of them,
so a half (describe()) carries every rank's agent, gathered over the TP group at attach.
Each rank takes from the peer's half the agents head_map.plan_writes pairs it with."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.pd import protocol as pd
from tandem.pd.control.channel import ControlChannel
from tandem.pd.control.follower import FollowerChannel
from tandem.pd.identity import identity_of
from tandem.pd.transfer.contract import KVTransfer, TransferError
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.pd.transfer.head_map import Staging, Write, plan_writes, staging_of
from tandem.protocol.kv_layout import KVLayout
from tandem.worker_contract import (
    DEFAULT_KV_PORT_COUNT,
    ENV_KV_PORT_BASE,
    ENV_KV_PORT_COUNT,
    ENV_PD_SECRET,
    PREFILL,
)

if TYPE_CHECKING:
    from tandem.engine.parallel.group import TPGroup
    from tandem.engine.scheduler.role_part import Host


def confine_ucx_ports(environ: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """UCX's TCP transport listens on random ports; keep them in TANDEM_KV_PORT_BASE's range."""
    if ENV_KV_PORT_BASE in environ and "UCX_TCP_PORT_RANGE" not in environ:
        base = int(environ[ENV_KV_PORT_BASE])
        count = int(environ.get(ENV_KV_PORT_COUNT, DEFAULT_KV_PORT_COUNT))
        environ["UCX_TCP_PORT_RANGE"] = f"{base}-{base + count - 1}"


@dataclass(frozen=True)
class Link:
    """This TP rank's side of one handshake: its writes in the plan (as the prefill rank of
    each, or the decode rank), the agents and layouts of the peer ranks it pairs with, by
    peer TP rank, and what decode stages for head slices (the same on every rank).

    `pages` and `slots` bound what the peer may name (the least over all its ranks, so every
    rank of this side judges a peer's message alike): a decode's pages lie in 1..pages-1 and
    its first-token slot below slots; a prefill takes at most `slots` rooms at once."""

    writes: tuple[Write, ...]
    agents: dict[int, str] = field(default_factory=dict)
    layouts: dict[int, KVLayout] = field(default_factory=dict)
    staging: Staging = Staging()
    pages: int = 0
    slots: int = 0


@dataclass
class TransferParts:
    transfer: KVTransfer
    channel: ControlChannel | FollowerChannel
    identity: pd.Identity
    layout: KVLayout
    slots: FirstTokenSlots
    role: str  # worker_contract.PREFILL or DECODE: this side of head_map's plan
    tp: TPGroup
    halves: list[dict[str, Any]]  # every TP rank's {layout, agent, meta}, in rank order

    @property
    def name(self) -> str:
        return self.transfer.name

    def describe(self) -> dict[str, Any]:
        """This side's half of the handshake (the body of Hello and of an accepting Welcome)."""
        return {"identity": dataclasses.asdict(self.identity), **self.halves[0], "ranks": self.halves[1:]}

    def add_peer(self, msg: pd.Hello | pd.Welcome) -> tuple[Link | None, list[str]]:
        """Take the other side's half (checked by pd.decode already): (this rank's Link, [])
        or (None, the problems as "field: detail", for this side's log; refused() says what
        the peer may be told). A collective under TP: every rank handles the same message in
        the same tick, and the handshake holds only if every rank added its peers."""
        problems = self.identity.mismatch(pd.Identity(**msg.identity))
        if problems:
            return None, problems
        halves = [{"layout": msg.layout, "agent": msg.agent, "meta": msg.meta}, *msg.ranks]
        try:
            agents = [base64.b64decode(h["agent"], validate=True) for h in halves]
        except ValueError:
            return None, ["agent: not base64"]
        try:
            link = self._plan([KVLayout(**h["layout"]) for h in halves])
        except ValueError as exc:  # the ranks do not split one model's heads between them
            return None, [f"layout: {exc}"]
        link = dataclasses.replace(link, pages=min(h["layout"]["num_pages"] for h in halves),
                                   slots=min(h["meta"]["slots"] for h in halves))
        problem = ""
        for r in sorted({w.decode if self.role == PREFILL else w.prefill for w in link.writes}):
            try:
                link.layouts[r] = KVLayout(**halves[r]["layout"])
                link.agents[r] = self.transfer.add_peer(agents[r], link.layouts[r], pd.MetaRegion(**halves[r]["meta"]))
            except TransferError as exc:  # the transfer engine refused the metadata
                problem = f"agent: {exc}"
            except ValueError as exc:  # KVLayout.mismatch
                problem = f"layout: {exc}"
            if problem:
                break
        if self.tp.size > 1 and self.tp.min_int(0 if problem else 1) == 0:
            problem = problem or "agent: refused by another TP rank of this worker"
        if problem:
            self.drop(link)
            return None, [problem]
        return link, []

    def _plan(self, peer: list[KVLayout]) -> Link:
        """This rank's writes (its sends on prefill, what it receives on decode) and the plan's staging."""
        mine = [KVLayout(**h["layout"]) for h in self.halves]
        prefill, decode = (mine, peer) if self.role == PREFILL else (peer, mine)
        plan = plan_writes(prefill, decode)
        rank = (lambda w: w.prefill) if self.role == PREFILL else (lambda w: w.decode)
        return Link(tuple(w for w in plan if rank(w) == self.tp.rank), staging=staging_of(plan, decode))

    def drop(self, link: Link) -> None:
        """Forget a peer's agents: this rank's unfinished sends to them come back failed from poll."""
        for agent in link.agents.values():
            self.transfer.remove_peer(agent)


def refused(problems: list[str], detail: bool) -> str:
    """The handshake error: with detail for this side's log and its own requests; without, what
    a refusal tells the peer: the fields that differ, never this side's values (addresses,
    agent metadata)."""
    if detail:
        return "PD handshake refused: " + "; ".join(problems)
    return "PD handshake refused: mismatch in " + ", ".join(p.split(":", 1)[0] for p in problems)


def transfer_parts(host: Host, model_path: str, role: str) -> TransferParts:
    """A collective under TP: every rank builds its own agent, and all learn each other's."""
    from tandem.pd.transfer.nixl_agent import NixlTransfer

    confine_ucx_ports()
    cfg, tp = host.config, host.tp
    name = f"{role}-{uuid.uuid4().hex[:8]}-r{host.dp_rank}" + (f"-tp{tp.rank}" if tp.size > 1 else "")
    transfer = NixlTransfer(name, timeout=cfg.pd_transfer_timeout)
    channel: ControlChannel | FollowerChannel
    if tp.leader:
        # From the env only: a flag would show in `ps`, an engine option in /get_server_info.
        secret = os.environ.get(ENV_PD_SECRET) or None
        channel = ControlChannel(name, host.inbox, cfg.pd_heartbeat_interval, cfg.pd_heartbeat_timeout, secret)
    else:
        channel = FollowerChannel(name)
    layout = host.kv_pool.layout()
    slots = FirstTokenSlots(cfg.max_running_requests, device=host.kv_pool.kv_buffer.device)
    meta = transfer.register(layout, slots.region())
    half = {"layout": layout.to_dict(), "agent": base64.b64encode(meta).decode(),
            "meta": dataclasses.asdict(slots.region())}
    halves = [json.loads(h) for h in tp.all_gather_bytes(json.dumps(half).encode())]
    identity = identity_of(layout, cfg.deterministic, model_path, host.kv_pool.scales.digest())
    return TransferParts(transfer, channel, identity, layout, slots, role, tp, halves)
