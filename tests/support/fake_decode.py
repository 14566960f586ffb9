"""A fake decode for prefill's tests: a peer holding the PD secret whose handshake a real
prefill accepts (a real NIXL agent over a small KV pool of the model's shape, the model's
identity), then sends whatever KVDest a test writes: a hostile peer inside the deployment."""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid
from pathlib import Path

import torch
import zmq
from worker_process import PD_SECRET

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.pd import protocol as pd
from tandem.pd.control.auth import CurveKeys
from tandem.pd.identity import model_id
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.pd.transfer.nixl_agent import NixlTransfer

NUM_PAGES, SLOTS = 64, 4  # what its handshake declares: pages 1..63, slots 0..3


class FakeDecode:
    def __init__(self, model: Path, bootstrap: int, page_size: int = 1, declared_pages: int = NUM_PAGES) -> None:
        """`declared_pages`: the pool size its handshake claims (more than it registered: a lie
        prefill believes, so NIXL refuses what it writes past the real pool)."""
        cfg = json.loads((model / "config.json").read_text())
        heads, layers = cfg["num_key_value_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.pool = TokenToKVPool(NUM_PAGES, page_size, layers, heads, head_dim, torch.float32, "cpu")
        self.slots = FirstTokenSlots(SLOTS)
        self.name = f"fake-decode-{uuid.uuid4().hex[:8]}"
        self.transfer = NixlTransfer(self.name)
        agent = self.transfer.register(self.pool.layout(), self.slots.region())
        identity = pd.Identity(pd.PD_VERSION, model_id(str(model)), "float32", page_size, layers, heads, head_dim)
        layout = {**self.pool.layout().to_dict(), "num_pages": declared_pages}
        self.hello = pd.Hello(self.name, dataclasses.asdict(identity), layout,
                              base64.b64encode(agent).decode(), dataclasses.asdict(self.slots.region()))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        CurveKeys.from_secret(PD_SECRET).client(self.sock)
        self.sock.connect(f"tcp://127.0.0.1:{bootstrap}")

    def handshake(self) -> pd.Welcome:
        self.sock.send(pd.encode(self.hello))
        welcome = self.wait_for(pd.Welcome)
        assert welcome.ok, welcome.error
        return welcome

    def send(self, msg: pd.Message) -> None:
        self.sock.send(pd.encode(msg))

    def wait_for(self, kind: type, timeout: float = 30.0):
        """The next message of `kind`, heartbeating meanwhile (prefill forgets a silent peer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.send(pd.encode(pd.Heartbeat(self.name)))
            if self.sock.poll(200):
                msg = pd.decode(self.sock.recv())
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind.__name__} from prefill within {timeout} s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.transfer.close()
