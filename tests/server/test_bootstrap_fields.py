"""The PD routing fields of one request, read per job (tandem/protocol/bootstrap.py): a single
room names job i as room + i, a list names each job's own, and anything that could pair a job
with another's KV is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.protocol.bootstrap import ROOM_SPACE, Bootstrap


def test_no_fields_give_no_rooms() -> None:
    assert Bootstrap().job_bootstraps(3) == [{"bootstrap_host": None, "bootstrap_port": None,
                                              "bootstrap_room": None}] * 3


def test_one_room_numbers_the_jobs_and_wraps() -> None:
    jobs = Bootstrap(bootstrap_host="p", bootstrap_port=8998, bootstrap_room=ROOM_SPACE - 1).job_bootstraps(2)
    assert [j["bootstrap_room"] for j in jobs] == [ROOM_SPACE - 1, 0]
    assert {j["bootstrap_host"] for j in jobs} == {"p"}


def test_lists_name_each_jobs_peer_and_room() -> None:
    b = Bootstrap(bootstrap_host=["a", "b"], bootstrap_port=[1, 2], bootstrap_room=[9, 4])
    assert b.job_bootstraps(2) == [{"bootstrap_host": "a", "bootstrap_port": 1, "bootstrap_room": 9},
                                   {"bootstrap_host": "b", "bootstrap_port": 2, "bootstrap_room": 4}]


@pytest.mark.parametrize("fields", [{"bootstrap_room": [1, 2, 3]}, {"bootstrap_host": ["a"]},
                                    {"bootstrap_port": [1, 2, 3]}])
def test_a_list_of_the_wrong_length_is_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match="jobs"):
        Bootstrap(**fields).job_bootstraps(2)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=8))
def test_rooms_in_one_request_are_distinct_or_refused(rooms: list[int]) -> None:
    b = Bootstrap(bootstrap_room=rooms)
    if len(set(rooms)) < len(rooms):
        with pytest.raises(ValueError, match="twice"):
            b.job_bootstraps(len(rooms))
    else:
        assert [j["bootstrap_room"] for j in b.job_bootstraps(len(rooms))] == rooms
