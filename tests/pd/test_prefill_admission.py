"""What prefill admits, in-process: a decode's KVDest is checked against the prompt and the
bounds decode's handshake declared (prefill/dest_check.py), and a request takes a
first-token slot with it or waits for one, in order (prefill/slot_queue.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.pd import protocol as pd
from tandem.pd.parts import Link
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.pd.transfer.head_map import Staging
from tandem.prefill.dest_check import dest_problem
from tandem.prefill.outgoing import Outgoing
from tandem.prefill.slot_queue import SlotQueue

P = 4
LINK = Link((), pages=64, slots=8, staging=Staging(writes=1, per_page=2, num_pages=64))


def _dest(**kw) -> pd.KVDest:
    return pd.KVDest(**{"room": 1, "pages": [1, 2, 3], "skip": 0, "slot": 0, "prompt_len": 10, **kw})


def test_a_fitting_kvdest_passes() -> None:
    assert dest_problem(_dest(), 10, P, LINK) is None
    assert dest_problem(_dest(pages=[2, 3], skip=4), 10, P, LINK) is None  # decode had the first page
    assert dest_problem(_dest(staging=[[5, 6]]), 10, P, LINK) is None
    assert dest_problem(_dest(pages=[63, 62, 1], slot=7), 10, P, LINK) is None  # the last page, the last slot


@pytest.mark.parametrize(("fields", "why"), [
    ({"pages": [1, 2]}, "2 pages for 10 tokens"),
    ({"prompt_len": 11}, "11 tokens on decode"),
    ({"skip": 2}, "from 2"),  # not page-aligned
    ({"skip": 12, "pages": []}, "from 12"),  # past the prompt
    ({"pages": [1, 2, 64]}, "page 64 outside decode's 1..63"),
    ({"pages": [0, 1, 2]}, "page 0 outside"),  # the pad page
    ({"pages": [1, 2, 2**31 - 1]}, "outside decode's"),
    ({"slot": 8}, "first-token slot 8 outside decode's 0..7"),
    ({"staging": [[5, 64]]}, "staging: a page outside"),
    ({"staging": [[5]]}, "staging: 1 lists of 2 pages"),
])
def test_a_kvdest_past_a_bound_names_it(fields, why) -> None:
    problem = dest_problem(_dest(**fields), 10, P, LINK)
    assert problem is not None and why in problem, problem


def test_an_empty_link_accepts_nothing() -> None:
    """A Link without bounds (no handshake's) leaves no page or slot valid."""
    assert "outside" in dest_problem(_dest(), 10, P, Link(()))


def _og(room: int) -> Outgoing:
    return Outgoing(SimpleNamespace(rid=str(room)), room, 0.0)  # type: ignore[arg-type]


def test_requests_beyond_the_slots_wait_in_order_and_take_freed_slots() -> None:
    slots = FirstTokenSlots(2)
    q = SlotQueue(slots)
    a, b, c, d = (_og(i) for i in range(4))
    assert q.take(a) and q.take(b) and a.slot is not None and b.slot is not None
    assert not q.take(c) and not q.take(d) and c.slot is None and q.waited == 2
    assert q.grant() == []  # nothing freed yet
    slots.release(a.slot)
    assert q.grant() == [c] and c.slot is not None and list(q.waiting) == [d]
    e = _og(5)
    slots.release(b.slot)
    assert not q.take(e)  # a slot is free, but d came first
    assert q.grant() == [d] and list(q.waiting) == [e]
    q.leave(e)  # ended while waiting: it takes nothing
    slots.release(c.slot)
    assert q.grant() == [] and not q.waiting
    slots.release(d.slot)
    slots.check_integrity(in_use=0)
