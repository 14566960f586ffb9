"""Which prefill TP rank writes which KV heads into which decode TP rank
(tandem/pd/transfer/head_map.py): over every valid (H, prefill TP, decode TP), each decode
rank's every head is written exactly once, by a prefill rank holding it, and exactly one
write per decode rank carries the first token."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.pd.transfer.head_map import Write, plan_writes, shard_heads, staging_of
from tandem.protocol.kv_layout import KVLayout

BASE = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", itemsize=2, page_size=4,
                num_pages=8, base_ptr=1 << 20)


def ranks(total: int, tp: int) -> list[KVLayout]:
    out = []
    for r in range(tp):
        h0, h1 = shard_heads(total, tp, r)
        out.append(dataclasses.replace(BASE, num_kv_heads=h1 - h0, head_start=h0, total_kv_heads=total))
    return out


@st.composite
def tp_sizes(draw: st.DrawFn, total: int) -> int:
    """A TP size that splits `total` heads: a divisor of it, or a multiple (replicated heads)."""
    divisors = [t for t in range(1, total + 1) if total % t == 0]
    return draw(st.sampled_from(divisors) | st.integers(1, 4).map(lambda k: total * k))


@st.composite
def setups(draw: st.DrawFn) -> tuple[int, int, int]:
    total = draw(st.integers(1, 16))
    return total, draw(tp_sizes(total)), draw(tp_sizes(total))


@given(setups())
def test_every_decode_head_is_written_exactly_once_by_a_holder(setup: tuple[int, int, int]) -> None:
    total, tp_p, tp_d = setup
    prefill, decode = ranks(total, tp_p), ranks(total, tp_d)
    writes = plan_writes(prefill, decode)
    assert writes == sorted(writes, key=lambda w: (w.prefill, w.decode))
    assert len({(w.prefill, w.decode) for w in writes}) == len(writes)
    for d, lay in enumerate(decode):
        mine = [w for w in writes if w.decode == d]
        covered = sorted(h for w in mine for h in range(*w.heads))
        assert covered == list(range(*lay.heads)), (d, mine)  # every head, none twice
        for w in mine:
            src = prefill[w.prefill].heads
            assert w.heads[0] < w.heads[1] and src[0] <= w.heads[0] and w.heads[1] <= src[1]
            # the writer is the lowest prefill rank holding the heads
            assert not any(p.heads[0] <= w.heads[0] < p.heads[1] for p in prefill[: w.prefill])
            # staged exactly where one side is whole pages and the other is not
            assert w.gather == (w.heads == lay.heads != src)
            assert (w.scatter is not None) == (w.heads == src != lay.heads)
            if tp_p % tp_d == 0 or tp_d % tp_p == 0:  # nested TP sizes: a slice is one side's whole
                assert w.heads in (src, lay.heads)
        # decode's scatter writes, numbered in prefill order
        assert [w.scatter for w in mine if w.scatter is not None] == list(range(sum(w.scatter is not None
                                                                                    for w in mine)))
        staging = staging_of(writes, decode)
        if staging.writes:  # the same shape on every decode rank (they allocate in lockstep)
            assert sum(w.scatter is not None for w in mine) == staging.writes
            assert all(lay.num_kv_heads == staging.per_page * (w.heads[1] - w.heads[0])
                       for w in mine if w.scatter is not None)
        elif tp_p > tp_d and (tp_p % tp_d == 0 and total % tp_p == 0):
            raise AssertionError(f"nested TP {tp_p} -> {tp_d} of {total} heads should stage")
        assert sum(w.slot for w in mine) == 1
        assert next(w for w in mine if w.slot).prefill == min(w.prefill for w in mine)
        alone = plan_writes(prefill, [lay])  # what a prefill rank plans from one decode rank's Hello
        assert alone == [dataclasses.replace(w, decode=0) for w in mine]


def test_the_plans_the_module_docstring_names() -> None:
    assert plan_writes(ranks(4, 1), ranks(4, 2)) == [Write(0, 0, (0, 2), True, gather=True),
                                                     Write(0, 1, (2, 4), True, gather=True)]
    assert plan_writes(ranks(4, 2), ranks(4, 1)) == [Write(0, 0, (0, 2), True, scatter=0),
                                                     Write(1, 0, (2, 4), False, scatter=1)]
    assert plan_writes(ranks(4, 2), ranks(4, 2)) == [Write(0, 0, (0, 2), True), Write(1, 1, (2, 4), True)]
    # replicated on prefill (H=2, TP=4): ranks 0 and 2 hold heads 0 and 1 first; 1 and 3 write nothing
    assert plan_writes(ranks(2, 4), ranks(2, 1)) == [Write(0, 0, (0, 1), True, scatter=0),
                                                     Write(2, 0, (1, 2), False, scatter=1)]
    # replicated on decode: each copy of a head is written
    assert plan_writes(ranks(2, 1), ranks(2, 4)) == [Write(0, d, (d // 2, d // 2 + 1), True, gather=True)
                                                     for d in range(4)]


def test_layouts_that_are_not_one_models_split_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree"):
        plan_writes(ranks(4, 2), ranks(8, 2))
    with pytest.raises(ValueError, match="no prefill rank holds KV head 2"):
        plan_writes(ranks(4, 2)[:1], ranks(4, 1))
    inner = dataclasses.replace(BASE, num_kv_heads=1, head_start=1, total_kv_heads=3)
    outer = dataclasses.replace(BASE, num_kv_heads=3, head_start=0, total_kv_heads=3)
    with pytest.raises(ValueError, match="2 separate head ranges"):
        plan_writes([inner, outer], [outer])
    with pytest.raises(ValueError, match="cannot be split"):
        shard_heads(6, 4, 0)
    with pytest.raises(ValueError, match="no prefill"):
        plan_writes([], ranks(4, 1))
