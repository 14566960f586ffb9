"""The PD control channel's wire edge: reading one ZMQ message of a bounded shape, naming
the peer that sent it, and counting what is dropped, so nothing a peer sends can stop the
io thread or flood its log."""

from __future__ import annotations

import logging
import re
import time

import zmq

from tandem.pd.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

_NAMED = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def peer_name(ident: bytes) -> str:
    """A ZMQ routing id as a printable name: our agent names as they are, anything else as
    0x-hex (ZMQ's own ids are binary), so logs and maps never hold raw bytes."""
    return ident.decode() if _NAMED.fullmatch(ident) and not ident.startswith(b"0x") else "0x" + ident.hex()


def peer_ident(name: str) -> bytes:
    """The inverse of peer_name."""
    return bytes.fromhex(name[2:]) if name.startswith("0x") else name.encode()


def bounded_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a bigger frame disconnects its sender
    return s


def recv_frames(sock: zmq.Socket, keep: int) -> tuple[list[bytes], int] | None:
    """The next message waiting on `sock` (None if none): its first `keep` frames and how many
    it had. The rest are read and dropped, so a message of any shape is consumed whole."""
    try:
        frames = [sock.recv(zmq.NOBLOCK)]
    except zmq.Again:
        return None
    count = 1
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv()
        count += 1
        if len(frames) < keep:
            frames.append(frame)
    return frames, count


class Dropped:
    """Counts refused messages; warns at most every `every` seconds."""

    def __init__(self, every: float = 10.0) -> None:
        self.count, self.every, self._warned_at = 0, every, -every

    def __call__(self, peer: str, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._warned_at >= self.every:
            self._warned_at = now
            log.warning("dropped a control message from %s: %s (%d dropped so far)", peer[:80], why, self.count)
