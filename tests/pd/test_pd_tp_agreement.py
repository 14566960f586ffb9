"""The pieces that keep a tensor-parallel PD worker's ranks deciding alike, without processes:
the tick carries the control channel's messages to the other ranks, a handshake carries every
rank's agent (bounded), and a room counts as done only once every rank has reported it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.engine.parallel.group import TPGroup
from tandem.engine.parallel.tick import Tick
from tandem.pd import protocol as pd
from tandem.pd.agree import Agreement
from tandem.pd.control.channel import PeerDown, PeerMsg
from tandem.pd.tick_codec import TICK_CODEC
from tandem.protocol.kv_layout import KVLayout
from tandem.protocol.messages import AbortReq

IDENTITY = dataclasses.asdict(pd.Identity(pd.PD_VERSION, "m", "float32", 16, 2, 4, 8))
META = {"addr": 4096, "slot_bytes": 344, "slots": 4}


def _rank(start: int) -> dict:
    layout = KVLayout(2, 2, 8, "float32", 4, 16, 64, 1 << 20, head_start=start, total_kv_heads=4)
    return {"layout": layout.to_dict(), "agent": "bWV0YQ==", "meta": META}


class _Ranks(TPGroup):
    """Rank 0 of a group whose other ranks report what the test scripts."""

    def __init__(self, size: int) -> None:
        super().__init__(0, size, None, None)
        self.others: list[list] = [[] for _ in range(size - 1)]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data, *[json.dumps(o).encode() for o in self.others]]


def test_the_tick_carries_control_messages_checked_again() -> None:
    hello = pd.Hello("decode-0", IDENTITY, **_rank(0), ranks=[_rank(2)])
    tick = Tick(3.0, [PeerMsg("d", hello), AbortReq("a"), PeerDown("d", "no heartbeat")])
    back = Tick.decode(tick.encode(TICK_CODEC), TICK_CODEC)
    assert back == tick and back.msgs[0].msg.ranks[0]["layout"]["head_start"] == 2
    with pytest.raises(AssertionError, match="codec"):
        Tick.decode(tick.encode(TICK_CODEC))  # a part's message needs the part's codec


def test_a_handshake_carries_every_rank_within_bounds() -> None:
    hello = pd.Hello("decode-0", IDENTITY, **_rank(0), ranks=[_rank(2)])
    assert pd.decode(pd.encode(hello)) == hello
    many = dataclasses.replace(hello, ranks=[_rank(2)] * pd.MAX_TP_RANKS)
    with pytest.raises(pd.BadMessage, match="ranks"):
        pd.decode(pd.encode(many))
    half_empty = dataclasses.replace(hello, ranks=[{"layout": {}, "agent": "", "meta": {}}])
    with pytest.raises(pd.BadMessage, match="every rank"):
        pd.decode(pd.encode(half_empty))
    refusal = pd.Welcome("p", False, "no", ranks=[_rank(2)])
    with pytest.raises(pd.BadMessage, match="only its error"):
        pd.decode(pd.encode(refusal))


def test_a_room_is_done_once_every_rank_reported_it() -> None:
    tp = _Ranks(2)
    agree = Agreement(tp)
    assert agree.done([("7:1", "")]) == [] and len(agree) == 1  # rank 1 has not seen it yet
    tp.others = [[["9:1", ""], ["7:1", ""]]]
    assert agree.done([]) == [("7:1", "")] and len(agree) == 1  # 9:1 waits for rank 0
    tp.others = [[]]
    assert agree.done([("9:1", "")]) == [("9:1", "")] and len(agree) == 0


def test_a_failure_on_any_rank_fails_the_room_and_an_ended_room_is_forgotten() -> None:
    tp = _Ranks(3)
    agree = Agreement(tp)
    tp.others = [[["5:2", "KV transfer failed: rank 1"]], [["5:2", "KV transfer failed: rank 2"]]]
    assert agree.done([("5:2", "")]) == [("5:2", "KV transfer failed: rank 1")]  # the lowest rank's error
    tp.others = [[["8", ""]], []]
    assert agree.done([]) == []
    agree.forget("8")  # room 8 ended: when it is used again, rank 1's old report must not count
    tp.others = [[], []]
    assert agree.done([("8", "")]) == [] and len(agree) == 1


def test_one_rank_agrees_with_itself_without_a_collective() -> None:
    agree = Agreement(TPGroup(0, 1, None, None))
    assert agree.done([("1", ""), ("2", "x")]) == [("1", ""), ("2", "x")] and len(agree) == 0
