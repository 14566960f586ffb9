"""Agreement: what is done on every TP rank of a worker.

NIXL's events are each rank's own (its sends, the notifications its shard received) and
come at different moments, but the scheduler must decide alike on every rank: free a
prefill room's pages, admit a decode room as arrived. So each rank reports what finished
locally, every rank learns all reports in one collective, and a key (a room, a chunk of
one) counts as done once every rank has reported it, failed if any rank failed it:

    rank 0 reports  room 7 ok          -> waits (1 of 2)
    rank 1 reports  room 7 ok, room 9  -> room 7 done on both; room 9 waits

Every rank calls `done` at the same point of the same loop iteration (the role part's
poll) whenever one calls it. With one rank there is nothing to agree on: no collective.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.parallel.group import TPGroup

Report = tuple[str, str]  # (key, "" if it went well, or what failed)


class Agreement:
    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.seen: dict[str, list] = {}  # key -> [ranks that reported it, the first rank's error]

    def done(self, local: list[Report]) -> list[Report]:
        """This rank's new reports -> those now reported by every rank, in the same order
        on every rank (the error is the lowest rank's that failed)."""
        if self.tp.size == 1:
            return local
        out: list[Report] = []
        for data in self.tp.all_gather_bytes(json.dumps(local).encode()):
            for key, error in json.loads(data):
                seen = self.seen.setdefault(key, [0, ""])
                seen[0] += 1
                seen[1] = seen[1] or error
                if seen[0] == self.tp.size:
                    out.append((key, seen[1]))
                    del self.seen[key]
        return out

    def forget(self, key: str) -> None:
        """The key's owner ended (on every rank alike): reports some ranks made go, so a
        room number used again later starts from none."""
        self.seen.pop(key, None)

    def __len__(self) -> int:
        return len(self.seen)
