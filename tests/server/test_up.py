"""`tandem up` as a user runs it: the whole stack comes up, serves the openai client, and
goes down on SIGTERM/SIGINT or when a component dies, leaving no process and no port."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from up_stack import Stack, _children, _pools_whole  # noqa: E402
from waits import wait_until  # noqa: E402

DASHBOARD = Path(__file__).parents[2] / "charts/tandem/dashboards/tandem.json"


def _dashboard_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert panels and all(p["targets"] for p in panels)
    return {m for p in panels for t in p["targets"] for m in re.findall(r"\btandem_[a-z_]+", t["expr"])}


def _exported(text: str) -> set[str]:
    """Series names a /metrics text has, histograms under their _bucket/_sum/_count names too."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "histogram":
                names |= {name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def test_up_pd_serves_openai_and_stops_clean(model_path):
    stack = Stack(model_path("tiny")).wait_up()
    try:
        assert set(stack.state()) == {"prefill-0", "decode-0", "router"}
        out = stack.output()
        assert "Tandem is up" in out and f"http://127.0.0.1:{stack.port}/v1" in out and "curl" in out
        assert "asked 'What is the capital of France?' through the openai client (random weights" in out
        client = stack.client()
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
        chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 5
        # Every series the Grafana dashboard queries is exported by the live router or a worker.
        exported = set().union(*(_exported(httpx.get(info["url"] + "/metrics", timeout=10).text)
                                 for info in stack.state().values()))
        assert not _dashboard_metrics() - exported, _dashboard_metrics() - exported
        _pools_whole(stack)
    finally:
        code = stack.stop(signal.SIGTERM)
    assert code == 0, stack.output()
    stack.assert_gone()
    assert "stopped; no process left" in stack.output()


def test_up_colocated_dp(model_path):
    stack = Stack(model_path("tiny"), "--colocated", "--dp", "2").wait_up()
    try:
        workers = httpx.get(stack.url + "/workers", timeout=10).json()["workers"]
        assert len(workers) == 2 and all(w["healthy"] and w["role"] == "colocated" for w in workers)
        for _ in range(4):
            done = stack.client().completions.create(model="tiny", prompt="abc", max_tokens=4)
            assert done.usage.completion_tokens == 4
        # A stream in flight at Ctrl-C finishes: the router stops taking requests, the workers drain.
        stream = stack.client().completions.create(model="tiny", prompt="long", max_tokens=400, stream=True,
                                                   extra_body={"ignore_eos": True})
        first = next(iter(stream))
        stack.proc.send_signal(signal.SIGINT)
        finish = [c.choices[0].finish_reason for c in stream if c.choices]
        assert first.choices[0].text is not None and finish[-1] == "length", finish[-3:]
    finally:
        code = stack.stop(signal.SIGINT)  # Ctrl-C
    assert code == 0, stack.output()
    stack.assert_gone()


def test_up_restarts_then_goes_down_when_a_component_dies(model_path):
    stack = Stack(model_path("tiny"), "--restart", "1").wait_up()
    try:
        first = stack.state()["decode-0"]["pid"]
        os.killpg(first, signal.SIGKILL)
        def restarted() -> bool:
            assert stack.proc.poll() is None, stack.output()
            return (stack.state()["decode-0"]["pid"] != first
                    and httpx.get(stack.url + "/health/ready").status_code == 200)

        wait_until(restarted, 180, "decode-0 restarted and the stack ready", interval=0.5)
        assert "decode-0 exited (signal SIGKILL); restarting it (1/1)" in stack.output()
        # The restarted decode worker handshakes again, and the router readmits it.
        def answer() -> object:
            try:
                return stack.client().completions.create(model="tiny", prompt="again", max_tokens=3)
            except openai.APIError:
                return None

        done = wait_until(answer, 180, "an answer through the readmitted decode worker", interval=0.5)
        assert done.usage.completion_tokens == 3
        stack.tree |= _children(stack.proc.pid)
        os.killpg(stack.state()["decode-0"]["pid"], signal.SIGKILL)  # restarts are spent: the stack goes down
        code = stack.proc.wait(120)
    finally:
        stack.stop()
    assert code == 1, stack.output()
    assert "decode-0 exited (signal SIGKILL); taking the stack down" in stack.output()
    stack.assert_gone()
