"""RankSends: this TP rank's NIXL writes of each chunk, and the chunks done on every rank.

A chunk (one key, "room:chunk") is the same on every rank; its writes are this rank's share
of head_map's plan: one per decode rank it writes (several from TP 1 into TP 2, none from a
rank whose replicated heads another rank writes). A chunk is done here once all its writes
are reported, failed if one failed or was refused, and done for the sender once every rank
says so (tandem/pd/agree.py): only then may its source pages be freed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.pd.agree import Agreement, Report
from tandem.pd.transfer.contract import KVTransfer


class RankSends:
    def __init__(self, transfer: KVTransfer, agree: Agreement) -> None:
        self.transfer, self.agree = transfer, agree
        self.open: dict[str, list] = {}  # key -> [writes not reported yet, the first error]
        self.local: list[Report] = []  # done on this rank, not yet exchanged

    def start(self, key: str, writes: Sequence[Callable[[], None]]) -> None:
        """Start the chunk's writes; one refused ends the chunk (failed) once those started report."""
        started, error = 0, ""
        for write in writes:
            try:
                write()
            except (KeyError, ValueError) as exc:
                error = f"KV send refused: {exc}"
                break
            started += 1
        if started:
            self.open[key] = [started, error]
        else:
            self.local.append((key, error))

    def poll(self) -> list[Report]:
        """The chunks every rank has now seen done: (key, "" or why it failed)."""
        for sent in self.transfer.poll().sent:
            entry = self.open.get(sent.room)
            if entry is None:
                continue
            entry[0] -= 1
            if not sent.ok:
                entry[1] = entry[1] or f"KV transfer failed: {sent.error}"
            if entry[0] == 0:
                self.local.append((sent.room, entry[1]))
                del self.open[sent.room]
        local, self.local = self.local, []
        return self.agree.done(local)
