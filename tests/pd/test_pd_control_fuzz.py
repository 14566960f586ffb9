"""The PD control channel against hostile peers (tandem/pd/control/channel.py, tandem/pd/protocol.py).

A real prefill ControlChannel listens on 127.0.0.1, unauthenticated and with CURVE: fuzzed
messages (any frame count, random bytes and JSON, wrong field types, huge ints, 200k
nested brackets, non-UTF-8 routing ids) never stop its io thread, never reach the
scheduler's inbox unchecked, leave no per-peer state, and a real handshake with
heartbeats works afterwards. With a secret, a peer without it gets nothing at all."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pd_frames import KILLERS, fuzz_one, identities, messages

from tandem.local.plan import free_port
from tandem.pd import protocol as pd
from tandem.pd.control import channel as control
from tandem.pd.control.auth import CurveKeys
from tandem.pd.control.channel import ChannelDead, ControlChannel, PeerDown, PeerMsg
from tandem.pd.secret import new_pd_secret
from tandem.protocol.kv_layout import KVLayout

SECRET = new_pd_secret()
IDENTITY = pd.Identity(pd.PD_VERSION, "0123abcd", "float32", 16, 2, 2, 8)
LAYOUT = KVLayout(2, 2, 8, "float32", 4, 16, 64, 1 << 20)
HALF = {"identity": vars(IDENTITY), "layout": LAYOUT.to_dict(), "agent": "bWV0YQ==",
        "meta": {"addr": 4096, "slot_bytes": 344, "slots": 4}}


@pytest.fixture(scope="module", params=["open", "curve"])
def prefill(request):
    secret = SECRET if request.param == "curve" else None
    inbox: queue.Queue = queue.Queue()
    ch = ControlChannel("prefill-fuzz", inbox, interval=0.2, timeout=3.0, secret=secret)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ch.bind(endpoint)
    ch.start()
    ctx = zmq.Context()
    yield SimpleNamespace(channel=ch, inbox=inbox, endpoint=endpoint, secret=secret, ctx=ctx,
                          keys=CurveKeys.from_secret(secret) if secret else None)
    ch.close()
    ctx.term()
    assert not ch.thread.is_alive()


def _drain(inbox: queue.Queue) -> list:
    items = []
    while not inbox.empty():
        items.append(inbox.get_nowait())
    return items


def _wait_for(inbox: queue.Queue, pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            item = inbox.get(timeout=0.1)
        except queue.Empty:
            continue
        if pred(item):
            return item
    raise AssertionError("expected message never arrived")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ident=identities, message=messages)
def test_fuzzed_messages_never_stop_the_channel(prefill, ident, message) -> None:
    ack = fuzz_one(prefill.ctx, prefill.endpoint, ident, message, prefill.keys)
    assert isinstance(ack, pd.HeartbeatAck) and not ack.known  # a stranger is never "known"
    assert prefill.channel.alive()


def test_the_old_killers_then_a_real_handshake_and_heartbeats(prefill) -> None:
    for frame in KILLERS:
        fuzz_one(prefill.ctx, prefill.endpoint, b"\xff\xfekiller", [frame], prefill.keys)
    fuzz_one(prefill.ctx, prefill.endpoint, b"three", [b"a", b"b"], prefill.keys)  # 3 frames at the ROUTER
    for item in _drain(prefill.inbox):  # whatever got through is a well-typed message
        assert isinstance(item, PeerMsg) and pd.decode(pd.encode(item.msg)) == item.msg
    assert not prefill.channel.known and not prefill.channel.last_seen  # strangers leave no state
    dec_inbox: queue.Queue = queue.Queue()
    dec = ControlChannel("decode-fuzz-r0", dec_inbox, interval=0.2, timeout=3.0, secret=prefill.secret)
    dec.start()
    try:
        dec.connect("p", prefill.endpoint)
        dec.send("p", pd.Hello("decode-fuzz-r0", **HALF))
        hello = _wait_for(prefill.inbox, lambda m: isinstance(m, PeerMsg) and isinstance(m.msg, pd.Hello))
        assert hello.peer == "decode-fuzz-r0"
        prefill.channel.accept(hello.peer)
        prefill.channel.send(hello.peer, pd.Welcome("prefill-fuzz", True, "", **HALF))
        welcome = _wait_for(dec_inbox, lambda m: isinstance(m, PeerMsg))
        assert welcome.peer == "p" and isinstance(welcome.msg, pd.Welcome) and welcome.msg.ok
        dec.accept("p")
        time.sleep(1.5)  # sleep-ok: 7 heartbeat rounds, half the timeout
        assert not [m for m in _drain(dec_inbox) + _drain(prefill.inbox) if isinstance(m, PeerDown)]
        assert time.monotonic() - prefill.channel.last_seen[hello.peer] < 1.0  # its heartbeats arrive
        assert prefill.channel.alive() and dec.alive()
    finally:
        dec.close()
        prefill.channel.forget("decode-fuzz-r0")


def test_without_the_secret_a_peer_gets_nothing(prefill) -> None:
    hello = [pd.encode(pd.Hello("x", **HALF))]
    if prefill.secret is None:  # the open channel takes anyone (and warned so at start)
        assert isinstance(fuzz_one(prefill.ctx, prefill.endpoint, b"stranger", hello, None), pd.HeartbeatAck)
        _drain(prefill.inbox)
        return
    pub, sec = zmq.curve_keypair()
    stranger = SimpleNamespace(client=lambda s: (s.setsockopt(zmq.CURVE_SECRETKEY, sec),
                                                 s.setsockopt(zmq.CURVE_PUBLICKEY, pub),
                                                 s.setsockopt(zmq.CURVE_SERVERKEY, prefill.keys.public)))
    refused_before = prefill.channel.zap.refused
    for keys in (None, stranger, CurveKeys.from_secret(new_pd_secret())):
        with pytest.raises(AssertionError, match="stopped answering"):
            fuzz_one(prefill.ctx, prefill.endpoint, b"stranger", hello, keys, 700)
    assert prefill.channel.zap.refused > refused_before  # the one that knew the server key was asked about
    assert not [m for m in _drain(prefill.inbox) if isinstance(m, PeerMsg)]
    assert prefill.channel.alive()


def test_a_bad_endpoint_fails_its_peer_not_the_thread() -> None:
    inbox: queue.Queue = queue.Queue()
    ch = ControlChannel("decode-x", inbox, interval=0.2, timeout=3.0)
    ch.start()
    try:
        ch.connect("*:8998", "tcp://*:8998")  # EINVAL from zmq_connect
        down = _wait_for(inbox, lambda m: isinstance(m, PeerDown))
        assert down.peer == "*:8998" and "Invalid argument" in down.reason
        assert ch.alive() and not ch.dealers and not ch.last_seen
        ch.check()
    finally:
        ch.close()


def test_a_dead_io_thread_is_reported_on_the_scheduler_thread(monkeypatch) -> None:
    ch = ControlChannel("decode-y", queue.Queue(), interval=0.01, timeout=3.0)
    monkeypatch.setattr(ch, "_pass", lambda: 1 / 0)
    ch.start()
    ch.thread.join(10)
    assert not ch.alive() and isinstance(ch.crashed, ZeroDivisionError)
    with pytest.raises(ChannelDead, match="ZeroDivisionError"):
        ch.check()
    ch.send("p", pd.Heartbeat("x"))  # a command after the end neither raises nor blocks
    assert control.MAX_FAILED_PASSES > 1  # one bad pass alone is logged and survived


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200) | messages.map(lambda m: m[0]))
def test_decode_returns_a_checked_message_or_raises_bad_message(data: bytes) -> None:
    try:
        msg = pd.decode(data)
    except pd.BadMessage:
        return
    assert pd.decode(pd.encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40) | st.from_regex(rb"\A[0-9:+_ -]{1,30}\Z"))
@example(data=b"00:0:-")  # a leading zero once parsed, to a room notify() writes otherwise
def test_parse_notify_raises_only_bad_message(data: bytes) -> None:
    try:
        room, chunk, total = pd.parse_notify(data)
    except pd.BadMessage:
        return
    assert pd.notify(room, chunk, total) == data
