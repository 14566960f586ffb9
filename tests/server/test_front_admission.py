"""The front frees a request's admission slot and rid when its last output arrives, whether or
not its client has read it: a client that stops reading holds its connection, not capacity."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from waits import async_wait_until

pytest.importorskip("fastapi")
from tandem.protocol.messages import AbortReq, GenerateReq, ReqOutput  # noqa: E402
from tandem.server.choices import open_choices  # noqa: E402
from tandem.server.front import Front  # noqa: E402
from tandem.web.errors import ApiError  # noqa: E402


class FakeClient:
    def __init__(self, emit: Any) -> None:
        self.emit, self.sent, self.error, self.info = emit, [], None, {}

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def shutdown(self) -> None:
        pass


def test_a_finished_unread_request_frees_its_slot_and_name() -> None:
    async def main() -> None:
        front = Front(FakeClient, max_active=1)
        try:
            stream = front.open([1, 2], {"max_new_tokens": 1}, client_rid="mine")
            with pytest.raises(ApiError):  # the one slot is taken
                front.open([1], {"max_new_tokens": 1})
            gen = front.client.sent[-1]
            assert isinstance(gen, GenerateReq) and gen.rid != "mine"  # the scheduler never sees the client's rid
            front.client.emit([ReqOutput(gen.rid, [5], finished=True)])
            # Delivered on the loop (the front forgets the request); the client has read nothing.
            await async_wait_until(lambda: gen.rid not in front.active, 5, "the last output's delivery")
            again = front.open([1], {"max_new_tokens": 1}, client_rid="mine")
            assert (await stream.next()).token_ids == [5]  # the old answer is still there to read
            front.close(stream)
            assert not any(isinstance(m, AbortReq) for m in front.client.sent)  # finished: nothing to abort
            front.close(again)
        finally:
            front.shutdown()

    asyncio.run(main())


def test_one_request_holds_at_most_a_quarter_of_the_slots() -> None:
    """A batch (prompts x n) opened as many sequences as there were slots, then every other client
    got 429s while it ran (issue 38). Past its share it is a 400 and opens nothing."""

    async def main() -> None:
        front = Front(FakeClient, max_active=16)
        tokens = SimpleNamespace(tok=None)
        jobs = [([1, 2], {"max_new_tokens": 1})]
        try:
            with pytest.raises(ApiError) as big:
                open_choices(front, tokens, jobs * 5)
            assert big.value.status == 400 and "at most 4 per request" in big.value.message
            assert front.client.sent == [] and not front.active
            held = [open_choices(front, tokens, jobs * n) for n in (4, 4, 4, 3)]  # clients at (near) their share
            assert len(front.active) == 15
            with pytest.raises(ApiError) as full:  # two would pass the slots: refused whole, nothing opened
                open_choices(front, tokens, jobs * 2)
            assert full.value.status == 429 and len(front.active) == 15
            held.append(open_choices(front, tokens, jobs))
            for c in [c for choices in held for c in choices]:
                front.close(c.stream)
            assert not front.active
        finally:
            front.shutdown()

    asyncio.run(main())
