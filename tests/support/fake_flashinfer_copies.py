"""The asynchronous half of the FlashInfer stand-in: what `plan` hands to the device, and when.

FlashInfer's `plan` reads its host inputs (indptr, last_page_len, qo_indptr), writes the plan
it derives from them into a pinned host buffer owned by the wrapper, and queues copies to the
device without waiting for them. Two caller mistakes follow, each silent on a GPU until a
kernel reads a page table that disagrees with its schedule; the stand-in turns both into errors:

- host inputs changed before their copy landed. The stand-in keeps the caller's host tensors by
  reference and checks them against the values plan read, at every `run` and when the copy
  lands. Once it has landed the host tensors are the caller's again.
- a wrapper re-planned while a run issued on its previous plan may still wait for that plan's
  copy: the pinned buffer would carry the new plan into the old run. `plan` refuses this.

The device is the CPU here and has no queue, so a copy lands only when the host learns that it
has: by waiting on an event recorded after the plan. `install` makes `torch.cpu.Event` (the
event the FlashInfer backend records on CPU) and `torch.cpu.synchronize` that fence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IN_FLIGHT: list[PendingCopy] = []


@dataclass(eq=False)  # identity: IN_FLIGHT holds copies, and tensors have no truth value
class PendingCopy:
    """One plan's copy to the device: the caller's host tensors and what plan read from them."""

    host: dict[str, torch.Tensor]
    planned: dict[str, torch.Tensor] = field(init=False)
    ran: bool = False  # a run was issued that reads this copy
    landed: bool = False

    def __post_init__(self) -> None:
        self.planned = {name: t.clone() for name, t in self.host.items()}

    def check(self, when: str) -> None:
        for name, t in self.host.items():
            if t.shape != self.planned[name].shape or not torch.equal(t, self.planned[name]):
                raise RuntimeError(
                    f"{name} changed {when}: FlashInfer copies plan()'s host inputs to the device "
                    "asynchronously, so the kernel would read a page table that disagrees with its "
                    "plan. Keep them unchanged until an event recorded after plan() has completed.")

    def land(self) -> None:
        self.check("between plan() and the landing of its copy to the device")
        self.host = self.planned
        self.landed = True
        if self in IN_FLIGHT:
            IN_FLIGHT.remove(self)


class PinnedPlan:
    """A wrapper's pinned plan buffer: it holds one plan, whose copy may still be in flight."""

    def __init__(self) -> None:
        self.copy: PendingCopy | None = None

    def replan(self, host: dict[str, torch.Tensor]) -> PendingCopy:
        prev = self.copy
        if prev is not None and not prev.landed:
            if prev.ran:
                raise RuntimeError(
                    "plan() would overwrite this wrapper's pinned plan buffer while a run issued on "
                    "the previous plan may still wait for its copy to the device; wait for an event "
                    "recorded after the previous plan() before planning the wrapper again.")
            IN_FLIGHT.remove(prev)  # nothing read it: the new plan simply replaces it
        self.copy = PendingCopy(host)
        IN_FLIGHT.append(self.copy)
        return self.copy


class Fence:
    """`torch.cpu.Event` under the stand-in: completing it lands every plan copy queued before
    it was recorded, as a CUDA event recorded after `plan` does on the plan's stream."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._covers: list[PendingCopy] = []

    def record(self, stream: object = None) -> None:
        self._covers = list(IN_FLIGHT)

    def synchronize(self) -> None:
        for copy in self._covers:
            if not copy.landed:
                copy.land()

    def query(self) -> bool:
        self.synchronize()  # the host now knows the copies landed
        return True

    def wait(self, stream: object = None) -> None:
        """A device-side wait: the host learns nothing from it."""


def synchronize(device: object = None) -> None:
    """`torch.cpu.synchronize` under the stand-in: the whole queue has run."""
    for copy in list(IN_FLIGHT):
        copy.land()


def install(monkeypatch: object) -> None:
    IN_FLIGHT.clear()
    monkeypatch.setattr(torch.cpu, "Event", Fence)  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.cpu, "synchronize", synchronize)  # type: ignore[attr-defined]
