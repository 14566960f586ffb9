"""Who may talk on the PD control channel: ZMQ CURVE with one shared secret.

Every worker of a deployment holds the same PD secret (tandem/pd/secret.py) and
uses it as its CURVE secret key, so all of them have the same public key:

    prefill ROUTER: CURVE server, secret key S   --ZAP-->  accepts a client only if its key is P
    decode DEALER:  CURVE client, secret key S, server key P (so it talks only to a holder of S)
                                                             P = curve_public(S)

A peer without S can neither complete the handshake with a prefill nor pose as one to a
decode; with CURVE the traffic is also encrypted. The ZAP handler is a REP socket on the
channel's own context, served by the channel's io thread: no thread of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from tandem.pd.secret import check_pd_secret

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27), one per context
ZAP_DOMAIN = b"tandem-pd"


@dataclass(frozen=True)
class CurveKeys:
    secret: bytes  # Z85
    public: bytes  # Z85

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        key = check_pd_secret(secret).encode()
        return cls(key, zmq.curve_public(key))

    def server(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def client(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)


class ZapHandler:
    """Answers libzmq's authentication requests for the CURVE server sockets of `ctx`."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self.allowed = z85.decode(keys.public)  # ZAP hands over the client's key as 32 raw bytes
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.refused = 0

    def handle(self) -> None:
        """Answer every request waiting. A REP socket that took a request must reply before it
        can take the next, so every request gets an answer, refusing when it is malformed."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            # version, request id, domain, address, routing id, mechanism, credentials...
            ok = (len(frames) == 7 and frames[0] == b"1.0" and frames[5] == b"CURVE"
                  and frames[6] == self.allowed)
            if not ok:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("PD control channel: refused a peer without the PD secret (%d so far)", self.refused)
            request_id = frames[1] if len(frames) > 1 else b""
            self.sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                      b"OK" if ok else b"unknown key", b"pd-peer" if ok else b"", b""])

    def close(self) -> None:
        self.sock.close(linger=0)
