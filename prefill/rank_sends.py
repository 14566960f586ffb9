"""RankSends: this TP rank's NIXL writes of each chunk, and the chunks done on every rank.

A chunk (one key, "room:chunk") is the same on every rank; its writes are this rank's share
of head_map's plan: one per decode rank it writes (several from TP 1 into TP 2, none from a
rank whose replicated heads another rank writes). A `gather` write is packed into staging
pages first (prefill/staging.py), freed when the chunk is done on every rank; when the pool
has no room for them it waits, in order, for earlier chunks to free theirs. A `scatter`
write goes into the staging pages decode reserved for it (decode/staging.py) as whole
pages. A chunk is done here once all its writes are reported, failed if one failed or was
refused, and done for the sender once every rank says so (tandem/pd/agree.py): only then
may its source pages be freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tandem.pd.agree import Agreement, Report
from tandem.pd.parts import Link
from tandem.pd.transfer.contract import KVTransfer
from tandem.pd.transfer.head_map import Write
from tandem.pd.transfer.pages import staged_pages
from tandem.prefill.staging import SliceStaging
from tandem.protocol.kv_layout import KVLayout


@dataclass(frozen=True)
class Send:
    """One write of one chunk: to the agent of decode rank `write.decode`, into `dst` pages of
    `dest` (its pool, or seen at the slice's width for decode's staging pages)."""

    key: str
    agent: str | None
    write: Write
    src: Sequence[int]
    dst: Sequence[int]
    notify: bytes
    slot: tuple[int, int] | None
    dest: KVLayout | None = None


class RankSends:
    """Under TP every rank stages alike: what it stages and frees depends only on what every
    rank shares (the chunks started, the pool, the chunks agreed done), never on its own NIXL
    events, or the ranks' pools would drift apart."""

    def __init__(self, transfer: KVTransfer, agree: Agreement, staging: SliceStaging) -> None:
        self.transfer, self.agree, self.staging = transfer, agree, staging
        self.open: dict[str, list] = {}  # key -> [writes started or waiting, not reported yet; the first error]
        self.waiting: deque[Send] = deque()  # gather writes waiting for staging room, oldest first
        self.local: list[Report] = []  # done on this rank, not yet exchanged
        self.stats = {"unstaged_sends": 0, "waited_for_staging": 0, "scatter_sends": 0}

    def start(self, key: str, link: Link, src: Sequence[int], dst: Sequence[int], notify: bytes,
              slot: tuple[int, int] | None, staging: tuple[list[list[int]], int] = ([], 0)) -> None:
        """Start the chunk's writes: every decode rank this rank writes gets its heads of the
        pages, and the plan's one write per decode rank that carries the first token takes the
        slot. `staging`: decode's staging pages (KVDest.staging) and this chunk's first page
        among the room's, for `scatter` writes. One refused fails the chunk (once those
        started report); the writes after it are not sent."""
        entry = self.open[key] = [0, ""]
        for w in link.writes:
            one = Send(key, link.agents.get(w.decode), w, src, dst, notify, slot if w.slot else None)
            if w.scatter is not None and staging[0] and w.decode in link.layouts:  # into decode's staging
                try:  # decode's pages, checked on arrival (dest_check.py); refused here all the same
                    one = replace(one, dest=link.layouts[w.decode].sliced(w.heads), dst=staged_pages(
                        staging[0][w.scatter], staging[1], len(src), link.staging.per_page))
                except (LookupError, ValueError) as exc:
                    entry[1] = entry[1] or f"KV send refused: {exc}"
                    continue
                self.stats["scatter_sends"] += 1
            if w.gather and self.staging.fits(len(src), w.heads):
                self.waiting.append(one)
                entry[0] += 1
                continue
            self.stats["unstaged_sends"] += w.gather or (w.scatter is not None and one.dest is None)
            self._send(one)
        self._drain()
        self.stats["waited_for_staging"] += sum(one.key == key for one in self.waiting)
        self._settle(key)

    def _send(self, one: Send, staged: tuple[KVLayout, list[int]] | None = None) -> None:
        entry = self.open[one.key]
        if entry[1]:
            return  # the chunk failed already
        source, pages = staged if staged is not None else (None, one.src)
        try:
            if one.agent is None:
                raise KeyError(f"no agent for decode rank {one.write.decode}")
            self.transfer.send(one.agent, one.key, pages, one.dst, one.notify, slot=one.slot,
                               heads=one.write.heads, source=source, dest=one.dest)
        except (LookupError, ValueError) as exc:  # an index past a bound: this chunk fails, nothing else
            entry[1] = f"KV send refused: {exc}"
            return
        entry[0] += 1

    def _drain(self) -> None:
        """Stage and start waiting writes, in order, while the pool has room. A write waits only
        while some other chunk holds staging (its end frees it); otherwise no end would (a pool
        full of requests whose sends wait, or its own chunk's earlier write): it goes as slices."""
        while self.waiting:
            one = self.waiting[0]
            staged = self.staging.stage(one.key, one.src, one.write.heads)
            waiting = {w.key for w in self.waiting}
            if staged is None and any(k not in waiting for k in self.staging.held):
                return
            self.waiting.popleft()
            self.open[one.key][0] -= 1
            self.stats["unstaged_sends"] += staged is None
            self._send(one, staged)
            self._settle(one.key)

    def _settle(self, key: str) -> None:
        entry = self.open.get(key)
        if entry is not None and entry[0] == 0:
            del self.open[key]
            self.local.append((key, entry[1]))

    def poll(self) -> list[Report]:
        """The chunks every rank has now seen done: (key, "" or why it failed)."""
        for sent in self.transfer.poll().sent:
            entry = self.open.get(sent.room)
            if entry is None:
                continue
            entry[0] -= 1
            if not sent.ok:
                entry[1] = entry[1] or f"KV transfer failed: {sent.error}"
            self._settle(sent.room)
        local, self.local = self.local, []
        done = self.agree.done(local)
        for key, _ in done:  # read by no rank any more
            self.staging.release(key)
        self._drain()
        return done

    def status(self) -> dict[str, int]:
        return {**self.stats, **self.staging.stats}

    def check_integrity(self) -> None:
        # The idle self-check's language: a failure is this process's bug, never a peer's input.
        assert not self.open and not self.waiting and not len(self.agree), "chunk sends unreported while idle"
        self.staging.check_integrity()
