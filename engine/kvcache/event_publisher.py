"""KV events over ZMQ PUB, as vLLM publishes them (kv_events.py has the message shape), so a
subscriber written for vLLM (llm-d's KV-cache indexer, Dynamo's KV router) reads ours as is:

    PUB       multipart [topic, seq (8 bytes, big-endian), msgpack(batch)]
    ROUTER    (replay_endpoint) a subscriber that saw a gap sends [b"", start seq (8 bytes)]
              and gets every buffered [b"", seq, payload] from there, then [b"", -1, b""]

A thread owns both sockets (ZMQ sockets are not thread-safe), so the scheduler only puts a
batch on a queue: a slow or absent subscriber never stalls a step. PUB drops what a
subscriber's high-water mark cannot hold, which is what the replay buffer is for. Each DP rank
publishes on the endpoint's port plus its rank, as vLLM's do.

A replay request is a peer's bytes: a frame of the wrong shape is ignored, never trusted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

from tandem.protocol.kv_events import KVEventsConfig

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of DP rank `dp_rank`: a tcp port plus the rank, an ipc/inproc name with _dp<rank>."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, dp_rank: int = 0, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self._ctx = ctx or zmq.Context.instance()
        self._queue: queue.Queue[list[Any] | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic = config.topic.encode()
        self._seq = 0
        self.endpoint = offset_endpoint(config.endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, dp_rank)
        # Sockets are made here, so a bad endpoint fails the engine's start, not a thread later.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if config.binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint} / {self.replay_endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: list[Any]) -> None:
        self._queue.put(batch)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (until `timeout`), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError:
                    log.exception("kv events: replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encode(batch)
            seq, self._seq = self._seq, self._seq + 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("kv events: publish failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart(copy=True)  # type: ignore[union-attr]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:  # [identity, b"", seq]
            return  # not a replay request: a peer's bytes are not trusted
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", END_SEQ, b""))  # type: ignore[union-attr]
