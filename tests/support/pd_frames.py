"""Hostile input for the PD control channel (tandem/pd/control/channel.py), shared by the
in-process fuzz test (tests/pd/test_pd_control_fuzz.py) and the live one (test_pd_faults.py):
hypothesis strategies for whole messages as a peer sends them (any frame count, random
bytes, random JSON, PD messages with wrong fields) and the frames that once killed the io
thread, plus `fuzz_one`, which sends one message from a fresh DEALER and checks the channel
still answers that connection."""

from __future__ import annotations

import json
import struct
from itertools import count
from typing import Any

import zmq
from hypothesis import strategies as st

from tandem.pd import protocol as pd
from tandem.pd.control.auth import CurveKeys

# The frames that stopped the io thread before it checked what it read.
KILLERS = [b"[]", b"1", b"null", b'"x"', b"[" * 200_000, b"\xff\xfe\x00", b"",
           b'{"v":1,"type":"KVCancelled","body":{"room":' + b"9" * 100_000 + b"}}",
           b'{"v":1,"type":"Welcome","body":{"name":"p","ok":true,"error":"","identity":{},"layout":{},'
           b'"agent":"","meta":{}}}',
           b'{"v":1,"type":"Hello","body":[]}', b'{"v":1,"type":"__class__","body":{}}', b"NaN"]

_VALID = [pd.KVDest(1, [1, 2], 0, 0, 8), pd.KVDest(4, [1, 2], 0, 0, 8, [[3], [5]]), pd.KVCancel(2, "why"),
          pd.KVCancelled(3), pd.Heartbeat("d"),
          pd.HeartbeatAck("p", True), pd.Welcome("p", False, "no")]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A real PD message with one field replaced, removed or added."""
    obj = json.loads(pd.encode(draw(st.sampled_from(_VALID))))
    body = obj["body"]
    key = draw(st.sampled_from([*body, "extra"]))
    if draw(st.booleans()) and key in body:
        del body[key]
    else:
        body[key] = draw(json_values | st.integers(min_value=2**63, max_value=2**70))
    return json.dumps(obj).encode()


frames = st.one_of(st.sampled_from(KILLERS), st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode()),
                   mutated())
# A DEALER's message: 1 frame is a well-formed envelope, more arrive at the ROUTER as extra frames.
messages = st.lists(frames, min_size=1, max_size=4)
identities = st.binary(min_size=1, max_size=40)

_serial = count()


def fuzz_one(ctx: zmq.Context, endpoint: str, ident: bytes, message: list[bytes],
             keys: CurveKeys | None, timeout_ms: int = 5000) -> Any:
    """Send `message` as a peer with routing id `ident` (made unique), then a Heartbeat on the
    same connection; the HeartbeatAck proves the io thread read past the message. Returns it."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, ident[:200] + struct.pack(">I", next(_serial)))  # unique: a ROUTER refuses a twin
    if keys is not None:
        keys.client(s)
    try:
        s.connect(endpoint)
        s.send_multipart(message)
        s.send(pd.encode(pd.Heartbeat("fuzz")))
        assert s.poll(timeout_ms), "the control channel stopped answering"
        return pd.decode(s.recv())
    finally:
        s.close(linger=0)
