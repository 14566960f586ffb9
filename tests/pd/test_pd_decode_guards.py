"""What decode takes from outside, checked before use: the prefill address a request names
(decode/allowlist.py), the KV notifications and the first-token slot prefill writes
(decode/arrival.py, tandem/pd/transfer/first_token.py), and what a refused handshake tells
the peer (tandem/pd/parts.py). The PD secret's format (tandem/pd/secret.py)."""

from __future__ import annotations

import math
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from waits import wait_until

from tandem.decode.allowlist import Allowlist, PeerAddress, Verdict, parse_peers
from tandem.decode.arrival import Arrival
from tandem.pd import protocol as pd
from tandem.pd.parts import refused
from tandem.pd.secret import check_pd_secret, new_pd_secret
from tandem.pd.transfer.first_token import MAX_TOP, FirstTokenSlots
from tandem.protocol.logprobs import LOGPROB_FLOOR


def _resolver(table: dict[str, list[str]], calls: list[str], gate: threading.Event | None = None):
    def resolve(name, port, type=0):  # noqa: A002 (getaddrinfo's own keyword)
        calls.append(name)
        if gate is not None:
            gate.wait(10)
        if name not in table:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, type, 6, "", (ip, 0)) for ip in table[name]]

    return resolve


def _settle(allow: Allowlist, host: str, port: int, timeout: float = 5.0) -> tuple[str, str]:
    return wait_until(lambda: (got := allow.check(host, port))[0] != Verdict.PENDING and got, timeout,
                      f"a verdict on {host}:{port}", interval=0.01)


def test_parse_peers() -> None:
    assert parse_peers("prefill-svc.ns.svc.cluster.local:8998, 10.0.0.5:9000,[fd00::1]:8998") == [
        PeerAddress("prefill-svc.ns.svc.cluster.local", 8998), PeerAddress("10.0.0.5", 9000),
        PeerAddress("fd00::1", 8998)]
    assert PeerAddress("fd00::1", 8998).endpoint == "tcp://[fd00::1]:8998"
    assert parse_peers(None) == parse_peers(" , ") == []
    for bad in ("*:8998", "host", "host:0", "host:70000", "a b:1", ":8998"):
        with pytest.raises(ValueError, match="not host:port"):
            parse_peers(bad)


def test_only_configured_peers_and_what_they_resolve_to() -> None:
    calls: list[str] = []
    allow = Allowlist(parse_peers("prefill-svc:8998,127.0.0.1:9000"),
                      resolve=_resolver({"prefill-svc": ["10.0.0.5", "10.0.0.6"]}, calls))
    assert _settle(allow, "10.0.0.5", 8998) == (Verdict.ALLOWED, "10.0.0.5:8998")  # a pod behind the Service
    assert allow.check("PREFILL-SVC", 8998) == (Verdict.ALLOWED, "prefill-svc:8998")
    assert allow.check("127.0.0.1", 9000) == (Verdict.ALLOWED, "127.0.0.1:9000")
    for host, port in (("*", 8998), ("127.0.0.1", 1), ("10.0.0.5", 9001), ("evil.example.com", 8998),
                       ("127.0.0.1", 8998), ("", 8998), ("a b", 8998), ("10.0.0.5:1", 8998)):
        assert allow.check(host, port)[0] in (Verdict.REFUSED, Verdict.PENDING), (host, port)
        assert _settle(allow, host, port)[0] == Verdict.REFUSED, (host, port)
    assert "evil.example.com" not in calls and "*" not in calls  # a request's names are never looked up
    n = len(calls)
    for _ in range(20):  # misses within min_interval ask DNS no more
        allow.check("10.9.9.9", 8998)
    assert len(calls) <= n + 1


def test_a_new_pod_is_found_on_a_miss_without_blocking() -> None:
    table, calls, gate = {"prefill-svc": ["10.0.0.5"]}, [], threading.Event()
    gate.set()
    allow = Allowlist(parse_peers("prefill-svc:8998"), min_interval=0.0, resolve=_resolver(table, calls, gate))
    assert _settle(allow, "10.0.0.5", 8998)[0] == Verdict.ALLOWED
    table["prefill-svc"] = ["10.0.0.5", "10.0.0.7"]  # scaled up
    gate.clear()  # DNS hangs now
    t0 = time.monotonic()
    assert allow.check("10.0.0.7", 8998)[0] == Verdict.PENDING and allow.check("10.0.0.7", 8998)[0] == Verdict.PENDING
    assert time.monotonic() - t0 < 0.5  # the scheduler never waits on DNS
    gate.set()
    assert _settle(allow, "10.0.0.7", 8998) == (Verdict.ALLOWED, "10.0.0.7:8998")
    del table["prefill-svc"]  # DNS fails: what it resolved to before still holds
    assert _settle(allow, "10.0.0.5", 8998)[0] == Verdict.ALLOWED


def test_refusals_say_why() -> None:
    assert "no --pd-prefill-peers" in Allowlist([]).refusal("10.0.0.5", 8998)
    assert Allowlist([]).check("127.0.0.1", 8998)[0] == Verdict.REFUSED
    assert "'*':8998 is not a prefill peer" in Allowlist(parse_peers("p:8998")).refusal("*", 8998)


def test_notes_count_only_from_the_rooms_own_prefill() -> None:
    peers = SimpleNamespace(peers={"10.0.0.5:8998": SimpleNamespace(agents={"prefill-a"})})
    rooms = {7: SimpleNamespace(peer="10.0.0.5:8998"), 8: SimpleNamespace(peer="")}
    arrival = Arrival(peers)  # type: ignore[arg-type]
    assert arrival.note("prefill-a", pd.notify(7, 2, 2), rooms) == (rooms[7], 2)
    assert arrival.note("prefill-a", pd.notify(7, 1, None), rooms) == (rooms[7], None)
    assert arrival.note("prefill-a", pd.notify(9, 1, 1), rooms) is None  # a room that ended: ignored quietly
    for agent, note in (("prefill-b", pd.notify(7, 2, 2)), ("prefill-a", pd.notify(8, 1, 1)),
                        ("prefill-a", b"7:1:x"), ("prefill-a", b"\xff" * 100), ("prefill-a", b"")):
        assert arrival.note(agent, note, rooms) is None
    assert arrival.refused == 5


def test_a_bad_first_token_slot_is_refused() -> None:
    slots = FirstTokenSlots(2)
    slots.write(0, 41, -0.25, [(41, -0.25), (3, -2.0)])
    assert slots.read(0, vocab_size=64) == (41, -0.25, [(41, -0.25), (3, -2.0)])
    for col, value in ((0, 64), (0, -1), (0, math.nan), (0, 1.5), (0, math.inf), (1, math.inf),
                       (2, MAX_TOP + 1), (3, 99), (3 + MAX_TOP, math.nan)):
        slots.write(1, 41, -0.25, [(41, -0.25)])
        slots.buf[1, col] = value
        with pytest.raises(ValueError):
            slots.read(1, vocab_size=64)


def test_a_token_the_grammar_ruled_out_reads_as_the_floor() -> None:
    """A grammar mask leaves blocked tokens at -inf: the slot of a prefill that sends them as
    they are is no attack, and decode reads them as the floor every route reports."""
    slots = FirstTokenSlots(1)
    slots.write(0, 41, -math.inf, [(41, 0.0), (3, -math.inf)])
    assert slots.read(0, vocab_size=64) == (41, LOGPROB_FLOOR, [(41, 0.0), (3, LOGPROB_FLOOR)])
    slots.buf[0, 3 + MAX_TOP] = 0.5  # a probability above 1 is no logprob
    with pytest.raises(ValueError):
        slots.read(0, vocab_size=64)


def test_a_refused_handshake_names_fields_not_values() -> None:
    problems = ["page_size: 1 != 16", "agent: NIXL refused the peer's agent metadata (nixlMismatchError)"]
    told = refused(problems, detail=False)
    assert told == "PD handshake refused: mismatch in page_size, agent" and "16" not in told
    assert "1 != 16" in refused(problems, detail=True)
    meta = b'"meta":{"addr":4096,"slot_bytes":8,"slots":1}'
    leaky = pd.encode(pd.Welcome("p", False, told)).replace(b'"meta":{}', meta)
    with pytest.raises(pd.BadMessage, match="only its error"):
        pd.decode(leaky)


def test_pd_secret_is_a_curve_key() -> None:
    a, b = new_pd_secret(), new_pd_secret()
    assert a != b and len(a) == 40 and check_pd_secret(a) == a
    assert zmq.curve_public(a.encode()) != zmq.curve_public(b.encode())  # libzmq takes it as it is
    for bad in ("", "x" * 39, " " * 40, "#" * 40):  # "####": five digits past 2**32
        with pytest.raises(ValueError, match="40 characters of Z85") as err:
            check_pd_secret(bad)
        assert bad not in str(err.value) or not bad


def test_the_operator_passes_the_secret_from_a_secret() -> None:
    from tandem import worker_contract as contract

    assert contract.pd_secret_env("llama-pd") == {"name": "TANDEM_PD_SECRET", "valueFrom": {
        "secretKeyRef": {"name": "llama-pd", "key": contract.PD_SECRET_KEY}}}
