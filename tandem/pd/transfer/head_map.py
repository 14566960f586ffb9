"""Which prefill TP rank writes which KV heads into which decode TP rank, torch-free.

Each TP rank's pool holds a range of the model's H KV heads (KVLayout.heads, `shard_heads`):

    T divides H (H=4, T=2):  rank 0: [0, 2)  rank 1: [2, 4)          a block each
    H divides T (H=2, T=4):  rank 0, 1: [0, 1)  rank 2, 3: [1, 2)    replicated

Every head of every decode rank must be written exactly once: by the lowest prefill rank
holding it (replicated prefill heads have several holders; one writes, deterministically).
A replicated decode head is written into each decode rank holding it. Example, H=4,
prefill TP=1 -> decode TP=2: (0 -> 0, heads [0, 2)), (0 -> 1, heads [2, 4)); prefill
TP=2 -> decode TP=1: (0 -> 0, [0, 2)), (1 -> 0, [2, 4)).

Where the TP sizes nest (one divides the other, as powers of two do) a slice is all of one
side's heads; otherwise (6 heads over TP 2 and TP 3) it may be neither, and goes as per-token
descriptors. Where it is all the decode rank holds but part of the prefill rank's
(prefill TP 1 -> decode TP 2) the write is `gather`:
the sender packs it into staging pages first (prefill/staging.py). Where it is all the
prefill rank holds but part of the decode rank's (prefill TP 2 -> decode TP 1) it is
`scatter`: decode reserves staging pages for it (KVDest.staging, one list per scatter write
of a decode rank, `Staging`), prefill writes whole pages there, and decode moves them into
its pages on arrival (decode/staging.py). Either way a send is whole page runs, not one
descriptor per token.

Every decode rank needs the request's first token too, in its own slot: exactly one write
per decode rank carries it (`Write.slot`), the one from the lowest prefill rank writing it.

A decode rank's writes depend on the prefill ranks' layouts and its own only, so a prefill
rank that has one decode rank's layout (its Hello) plans that pair alone:
plan_writes(prefill group, [that decode rank's layout]), decode index 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.protocol.kv_layout import HeadRange, KVLayout, shard_heads

__all__ = ["Staging", "Write", "plan_writes", "shard_heads", "staging_of"]


@dataclass(frozen=True)
class Write:
    prefill: int  # prefill TP rank
    decode: int  # decode TP rank
    heads: HeadRange  # the model's heads, held by both ranks: KVTransfer.send(heads=)
    slot: bool  # this write carries the first token into the decode rank's slot
    gather: bool = False  # all of the decode rank's heads, part of the prefill rank's: prefill stages
    scatter: int | None = None  # all of the prefill rank's, part of the decode rank's: decode stages, in
                                # the list of KVDest.staging at this index (the decode rank's n-th such write)


@dataclass(frozen=True)
class Staging:
    """What decode stages for a room (the same on every decode rank): `writes` lists of pool
    pages, each holding a room's n pages at `per_page` staged pages per pool page."""

    writes: int = 0
    per_page: int = 1
    num_pages: int = 2  # decode's pool pages: a staging page lies in 1 .. num_pages - 1

    def pool_pages(self, pages: int) -> int:
        return -(-pages // self.per_page)

    def problem(self, staging: list[list[int]], pages: int) -> str | None:
        """Why `staging` (a KVDest's, for a room of `pages` pages) is not what decode must send; None if it is."""
        if not staging:
            return None  # decode had no room to stage: the slices go as they lie
        want = self.pool_pages(pages)
        if len(staging) != self.writes or any(len(s) != want for s in staging):
            return f"staging: {self.writes} lists of {want} pages expected"
        if any(not 0 < p < self.num_pages for s in staging for p in s):
            return f"staging: a page outside 1..{self.num_pages - 1}"
        return None


def staging_of(writes: Sequence[Write], decode: Sequence[KVLayout]) -> Staging:
    """The Staging of a whole plan (every write, every decode rank's layout). Decode ranks
    allocate in lockstep, so staging needs every rank's scatter writes alike: as many, all of
    one width that divides the rank's heads; else none is staged (they go as slices)."""
    mine = [[w for w in writes if w.decode == d and w.scatter is not None] for d in range(len(decode))]
    widths = {w.heads[1] - w.heads[0] for ws in mine for w in ws}
    if not mine[0] or len({len(ws) for ws in mine}) != 1 or len(widths) != 1 \
            or len({(lay.num_kv_heads, lay.num_pages) for lay in decode}) != 1 or decode[0].num_kv_heads % min(widths):
        return Staging()
    return Staging(len(mine[0]), decode[0].slices_per_page(mine[0][0].heads), decode[0].num_pages)


def plan_writes(prefill: Sequence[KVLayout], decode: Sequence[KVLayout]) -> list[Write]:
    """The writes, ordered by (prefill, decode) rank, that fill every decode rank's heads once.
    ValueError when the layouts do not describe one model's heads, or a decode head has no
    prefill holder, or a prefill rank would write one decode rank two separate ranges
    (not a TP split: shard_heads never gives one)."""
    if not prefill or not decode:
        raise ValueError("no prefill or no decode ranks")
    totals = {lay.total_heads for lay in (*prefill, *decode)}
    if len(totals) != 1:
        raise ValueError(f"the ranks disagree on the model's KV heads: {sorted(totals)}")
    ranges: dict[tuple[int, int], list[list[int]]] = {}  # (p, d) -> [first, end) runs
    for d, lay in enumerate(decode):
        for h in range(*lay.heads):
            p = next((p for p, src in enumerate(prefill) if src.heads[0] <= h < src.heads[1]), None)
            if p is None:
                raise ValueError(f"no prefill rank holds KV head {h}")
            runs = ranges.setdefault((p, d), [])
            if runs and runs[-1][1] == h:
                runs[-1][1] = h + 1
            else:
                runs.append([h, h + 1])
    writes: list[Write] = []
    for (p, d), runs in sorted(ranges.items()):
        if len(runs) != 1:
            raise ValueError(f"prefill rank {p} would write decode rank {d} {len(runs)} separate head ranges")
        slot = not any(w.decode == d for w in writes)  # sorted by p: the first write of d is the lowest p's
        heads = (runs[0][0], runs[0][1])
        scatter = sum(w.decode == d and w.scatter is not None for w in writes)
        writes.append(Write(p, d, heads, slot, gather=heads == decode[d].heads != prefill[p].heads,
                            scatter=scatter if heads == prefill[p].heads != decode[d].heads else None))
    return writes
