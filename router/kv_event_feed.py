"""The router's subscription to its workers' KV events: one ZMQ SUB socket a worker, at
tcp://<the worker's host>:<port> (`--kv-events-port`, or the worker's HTTP port plus
`--kv-events-port-offset`), kept in step with the worker set (discovery adds and removes
workers), feeding the EventIndex (kv_event_index.py).

Each batch carries a sequence number. A subscriber that joined late, or lost batches to PUB's
high-water mark, sees a gap: with `--kv-events-replay` it asks the worker's replay socket (one
port above) for
everything from the first batch it lacks (vLLM's replay protocol, engine/kvcache/event_publisher.py);
without one, or when the replay does not close the gap, it forgets the worker's index (better no
estimate than a wrong one) and follows the stream from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from tandem.router.kv_event_index import EventIndex
from tandem.router.workers import WorkerSet

log = logging.getLogger(__name__)
END_SEQ = -1
REPLAY_TIMEOUT = 2.0


class EventFeed:
    def __init__(self, index: EventIndex, workers: WorkerSet, port: int | None, offset: int | None = None,
                 replay: bool = False, topic: str = "") -> None:
        self.index, self.workers, self.fixed_port, self.offset, self.replay = index, workers, port, offset, replay
        self.topic = topic.encode()
        self.ctx = zmq.asyncio.Context.instance()
        self.subs: dict[str, zmq.asyncio.Socket] = {}
        self.next_seq: dict[str, int] = {}
        self.gaps = self.replayed = 0

    def _endpoint(self, url: str, replay: bool = False) -> str:
        w = self.workers.workers[url]
        port = self.fixed_port if self.fixed_port is not None else int(w.url.rsplit(":", 1)[1]) + (self.offset or 0)
        return f"tcp://{w.host}:{port + replay}"

    def sync(self) -> None:
        """Subscribe to new workers, drop the ones gone."""
        for url in [u for u in self.subs if u not in self.workers.workers]:
            self.subs.pop(url).close(linger=0)
            self.next_seq.pop(url, None)
            self.index.remove(url)
        for url in self.workers.workers:
            if url not in self.subs:
                sub = self.ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, self.topic)
                sub.setsockopt(zmq.LINGER, 0)
                sub.connect(self._endpoint(url))
                self.subs[url] = sub

    async def run(self) -> None:
        try:
            while True:
                self.sync()
                poller = zmq.asyncio.Poller()
                for sub in self.subs.values():
                    poller.register(sub, zmq.POLLIN)
                ready = dict(await poller.poll(timeout=500)) if self.subs else {}
                if not self.subs:
                    await asyncio.sleep(0.5)
                for url, sub in list(self.subs.items()):
                    if sub in ready:
                        await self._receive(url, sub)
        finally:
            for sub in self.subs.values():
                sub.close(linger=0)

    async def _receive(self, url: str, sub: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.index.rejected += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            expected = self.next_seq.get(url)
            if expected is not None and seq < expected:
                continue  # a replay already applied it
            if expected is None and seq > 0 or expected is not None and seq > expected:
                self.gaps += 1
                if not await self._replay(url, expected or 0, seq):
                    self.index.clear(url)  # unknown from here: follow the stream from this batch
            self.index.apply(url, frames[2])
            self.next_seq[url] = seq + 1

    async def _replay(self, url: str, start: int, until: int) -> bool:
        """Apply batches [start, until) from the worker's replay socket; whether the gap closed."""
        if not self.replay:
            return False
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got = start
        try:
            dealer.connect(self._endpoint(url, replay=True))
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT):
                    frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    return False
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    break
                if got <= seq < until:
                    if seq != got:
                        return False  # the worker's buffer no longer reaches back to `start`
                    self.index.apply(url, frames[2])
                    got = seq + 1
        except (TimeoutError, zmq.ZMQError):
            return False
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)
        self.replayed += 1
        return got == until
