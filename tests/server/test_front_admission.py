"""The front frees a request's admission slot and rid when its last output arrives, whether or
not its client has read it: a client that stops reading holds its connection, not capacity."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from waits import async_wait_until

pytest.importorskip("fastapi")
from tandem.protocol.messages import AbortReq, GenerateReq, ReqOutput  # noqa: E402
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
