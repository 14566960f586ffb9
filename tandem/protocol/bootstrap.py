"""PD routing fields (SGLang's): a PD router sends the same body to a prefill and a decode
worker, adding where the prefill's bootstrap server is and a room that names the request on
both sides.

A request of several jobs (the prompts of a batch, the `n` choices, or both) names each job's
room one of two ways, and both sides read it the same way:
- one room: job i is room + i (mod 2**63), which `tandem router` sends;
- a list of one room per job, which sgl-router sends for `n` > 1 and for batches (its host
  and port are then lists too). A list whose length is not the number of jobs is a 400:
  pairing jobs by position with a list of another length would cross two requests' KV.
A room named twice in one request is a 400 too: two decode jobs would wait on one prefill's KV.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from tandem.protocol import limits as L
from tandem.protocol.body import Body

Host = Annotated[str, Field(max_length=255)]
Port = Annotated[int, Field(ge=1, le=65535)]
Room = Annotated[int, Field(ge=0, lt=2**63)]
ROOM_SPACE = 2**63


def _per_job(name: str, value: Any, jobs: int) -> list[Any]:
    if not isinstance(value, list):
        return [value] * jobs
    if len(value) != jobs:
        raise ValueError(f"{name} lists {len(value)} values for {jobs} jobs; give one per job or a single value")
    return value


class Bootstrap(Body):
    bootstrap_host: Host | Annotated[list[Host], Field(min_length=1, max_length=L.MAX_PROMPTS)] | None = None
    bootstrap_port: Port | Annotated[list[Port], Field(min_length=1, max_length=L.MAX_PROMPTS)] | None = None
    bootstrap_room: Room | Annotated[list[Room], Field(min_length=1, max_length=L.MAX_PROMPTS)] | None = None

    def job_bootstraps(self, jobs: int) -> list[dict[str, Any]]:
        """Each job's (host, port, room); a ValueError names a list of the wrong length."""
        hosts = _per_job("bootstrap_host", self.bootstrap_host, jobs)
        ports = _per_job("bootstrap_port", self.bootstrap_port, jobs)
        room = self.bootstrap_room
        rooms = (_per_job("bootstrap_room", room, jobs) if isinstance(room, list) or room is None
                 else [(room + i) % ROOM_SPACE for i in range(jobs)])
        if room is not None and len(set(rooms)) != len(rooms):
            raise ValueError("bootstrap_room names a room twice; each job needs its own")
        return [{"bootstrap_host": h, "bootstrap_port": p, "bootstrap_room": r}
                for h, p, r in zip(hosts, ports, rooms)]
