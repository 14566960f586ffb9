"""TPGroup: the process group of one model replica's tensor-parallel ranks, and the few
collectives the engine uses.

    model      all_reduce (row-parallel o/down, the embedding), all_gather (the LM head's logits)
    scheduler  broadcast_bytes (rank 0's inputs each iteration, tick.py), all_gather_ints
               (the step digest, digest.py; the pool size every rank agrees on),
               all_gather_bytes (a PD role's handshake halves and transfers done per rank)

On CUDA the model's collectives run over NCCL; the scheduler's always over a second, gloo
group on the host, so a broadcast of inputs never waits behind a forward, nor mixes with one.
Nothing here unpickles: the scheduler sends bytes it decodes itself (tandem.protocol.messages), so a stranger on the
rendezvous port can at worst break the group, never run code in it.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A rank that stops answering (killed, wedged) fails its peers' next collective after this
# long instead of hanging them for ever; long enough for a cold start's first forward.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class TPGroup:
    def __init__(self, rank: int, size: int, device_group: object, cpu_group: object) -> None:
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group
        # Deterministic mode: sums in rank order (see all_reduce).
        self.ordered_sums = False

    @classmethod
    def init(cls, rank: int, size: int, addr: str, device: torch.device) -> TPGroup:
        """Join the group whose TCP rendezvous is `addr` ("host:port", rank 0 listens there)."""
        if size == 1:
            return cls(0, 1, None, None)
        host, _, port = addr.rpartition(":")
        if host in ("127.0.0.1", "localhost"):  # one pod: keep gloo's own sockets on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{int(port)}", rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT)
        # Its own group even on CPU: under overlap the forward thread all-reduces while the
        # scheduler thread broadcasts, and two threads sharing one group would interleave their
        # collectives differently on each rank.
        cpu = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, size, dist.group.WORLD, cpu)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- model --------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place.

        A ring all-reduce cuts the tensor into one chunk per rank, so which rank's value an
        element's sum starts from depends on the tensor's size, i.e. on the batch. Two addends
        commute exactly in IEEE arithmetic; three or more do not. With `ordered_sums` and more
        than two ranks every rank gathers the parts and adds them in rank order instead."""
        if self.size == 1:
            return x
        if not self.ordered_sums or self.size == 2:
            dist.all_reduce(x, group=self.device_group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        total = parts[0]
        for part in parts[1:]:
            total += part
        x.copy_(total)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, concatenated along the last dimension in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    # ---- scheduler ----------------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): a length, then the bytes."""
        if self.size == 1:
            assert data is not None  # invariant: a single rank is rank 0, which passes the data
            return data
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.cpu_group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            dist.broadcast(buf, src=0, group=self.cpu_group)
        return buf.numpy().tobytes() if int(n) else b""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Each rank's list of int64s (the same length on every rank), in rank order."""
        if self.size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.cpu_group)
        return [p.tolist() for p in parts]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Each rank's `data` (any length), in rank order: the lengths first, then the bytes
        padded to the longest."""
        if self.size == 1:
            return [data]
        lengths = [n[0] for n in self.all_gather_ints([len(data)])]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.cpu_group)
        return [p[:n].numpy().tobytes() for p, n in zip(parts, lengths)]

    def min_int(self, value: int) -> int:
        return min(v[0] for v in self.all_gather_ints([value]))

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = TPGroup(0, 1, None, None)
