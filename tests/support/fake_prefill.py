"""A fake prefill for decode's tests: a ZMQ ROUTER on a bootstrap port (CURVE with the tests'
PD secret, so decode completes the connection) that answers every Hello as `mode` says:

    silent      nothing
    empty       Welcome(ok=True, identity={}) as raw JSON (the schema forbids it)
    garbage     frames that once killed an io thread, and a 3-frame message
    bad-agent   a well-formed Welcome echoing decode's own half, with junk NIXL metadata
"""

from __future__ import annotations

import base64
import json
import threading

import zmq
from worker_process import PD_SECRET

from tandem.local.plan import free_port
from tandem.pd import protocol as pd
from tandem.pd.control.auth import CurveKeys

MODES = ("silent", "empty", "garbage", "bad-agent")


class FakePrefill:
    def __init__(self) -> None:
        self.port = free_port()
        self.mode = "silent"
        self.hellos = 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        CurveKeys.from_secret(PD_SECRET).server(self.sock)  # no ZAP handler here: any client key
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def key(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        while self.running:
            if not self.sock.poll(100):
                continue
            ident, data = self.sock.recv_multipart()[:2]
            msg = json.loads(data)
            if msg.get("type") == "Hello":
                self.hellos += 1
                for frames in self._answers(msg["body"]):
                    self.sock.send_multipart([ident, *frames])

    def _answers(self, hello: dict) -> list[list[bytes]]:
        if self.mode == "empty":
            body = {"name": "fake", "ok": True, "error": "", "identity": {}, "layout": {}, "agent": "", "meta": {},
                    "ranks": []}
            return [[json.dumps({"v": pd.PD_VERSION, "type": "Welcome", "body": body}).encode()]]
        if self.mode == "garbage":
            return [[b"[]"], [b"1"], [b"[" * 200_000], [b"\xff\xfe"], [b"a", b"b"]]
        if self.mode == "bad-agent":
            half = {k: hello[k] for k in ("identity", "layout", "meta")}
            return [[pd.encode(pd.Welcome("fake", True, "", agent=base64.b64encode(b"junk" * 8).decode(), **half))]]
        return []

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()
