"""SlotQueue: prefill takes a request only with a first-token slot for it.

A prefill worker has `max_running_requests` first-token slots (FirstTokenSlots) and twice
as many request rows, and decode, or several decodes, may send more KVDests than that: their
capacity is their own. So a slot is taken when prefill accepts a request's KVDest, before
the request joins the prefill queue, and held until its sends are done (sender._settle);
a KVDest that finds none free waits here, in arrival order, for the next one freed. The
slots are the bound on rooms in prefill's queue, prefill batches and NIXL at once: a
request can never reach its last chunk without one. The wait is bounded by the same
`pd_transfer_timeout` decode gives the transfer (sender.poll).

Under tensor parallelism every rank joins and grants alike: slots are freed only on what
every rank shares (sends agreed done) and granted at the same point of the same tick.
"""

from __future__ import annotations

from collections import deque

from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.prefill.outgoing import Outgoing


class SlotQueue:
    def __init__(self, slots: FirstTokenSlots) -> None:
        self.slots = slots
        self.waiting: deque[Outgoing] = deque()
        self.waited = 0  # requests that found no slot free (each counted once)

    def take(self, og: Outgoing) -> bool:
        """Give `og` a slot now if none waits before it and one is free; else it waits (False)."""
        if not self.waiting and self.slots.free:
            og.slot = self.slots.alloc()
            return True
        self.waiting.append(og)
        self.waited += 1
        return False

    def leave(self, og: Outgoing) -> None:
        """`og` ended while waiting: it takes no slot."""
        if og in self.waiting:
            self.waiting.remove(og)

    def grant(self) -> list[Outgoing]:
        """The waiting requests that get a slot now, oldest first."""
        granted = []
        while self.waiting and self.slots.free:
            og = self.waiting.popleft()
            og.slot = self.slots.alloc()
            granted.append(og)
        return granted
