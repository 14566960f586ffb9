"""Which prefill TP rank writes which KV heads into which decode TP rank, torch-free.

Each TP rank's pool holds a range of the model's H KV heads (KVLayout.heads, `shard_heads`):

    T divides H (H=4, T=2):  rank 0: [0, 2)  rank 1: [2, 4)          a block each
    H divides T (H=2, T=4):  rank 0, 1: [0, 1)  rank 2, 3: [1, 2)    replicated

Every head of every decode rank must be written exactly once: by the lowest prefill rank
holding it (replicated prefill heads have several holders; one writes, deterministically).
A replicated decode head is written into each decode rank holding it. Example, H=4,
prefill TP=1 -> decode TP=2: (0 -> 0, heads [0, 2)), (0 -> 1, heads [2, 4)); prefill
TP=2 -> decode TP=1: (0 -> 0, [0, 2)), (1 -> 0, [2, 4)).

A write whose heads are all the decode rank holds but only part of what the prefill rank
holds (prefill TP 1 -> decode TP 2) is `gather`: its bytes are strided on prefill and whole
pages on decode, so the sender first gathers them into whole pages of a staging buffer
(prefill/staging.py) and sends those, one descriptor per page run instead of one per token.

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

__all__ = ["Write", "plan_writes", "shard_heads"]


@dataclass(frozen=True)
class Write:
    prefill: int  # prefill TP rank
    decode: int  # decode TP rank
    heads: HeadRange  # the model's heads, held by both ranks: KVTransfer.send(heads=)
    slot: bool  # this write carries the first token into the decode rank's slot
    gather: bool = False  # all of the decode rank's heads, part of the prefill rank's: staged whole pages


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
        writes.append(Write(p, d, heads, slot, gather=heads == decode[d].heads != prefill[p].heads))
    return writes
