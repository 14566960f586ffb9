"""Every shell and Python block in README.md and docs/*.md runs as a reader pastes it, or says
why not (tests/support/doc_blocks.py has the annotations): a new doc command is covered by
default, and one that stops working fails here rather than for the next reader.

The docs name fixed ports (8000, 8100, 8200, 8998); CI runs pytest serially (.ci/run), so
nothing else listens there, and where something does the block is skipped, saying so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from doc_blocks import NEEDS, SERVES, SKIP, Block, Run, blocks, started
from waits import wait_until

from tandem.local.plan import bindable

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ALL = [b for path in DOCS for b in blocks(path)]
# A block's whole run: starting tiny-model servers on a loaded 2-core machine takes tens of seconds.
BLOCK_TIMEOUT_S = 240
STACK_PORT = 8000  # where the docs' tour expects `tandem up`
# The tour talks to `tandem up`'s default model, smollm2; the stack here serves the tiny preset
# under that name, so the blocks run unchanged without fetching the real model.
STACK = Block(REPO / "README.md", 0, "bash",
              f"tandem up --model tiny --served-model-name smollm2 --port {STACK_PORT} --run-dir stack "
              "--worker-args '--max-total-tokens 16384'\n", None)


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    assert ALL, "no code blocks found: the extraction is broken"
    problems = [f"{b.id}: {b.problem()}" for b in ALL if b.problem()]
    assert not problems, "\n".join(problems)


def _ports_free(ports: set[int]) -> None:
    taken = sorted(p for p in ports if not bindable("127.0.0.1", p))
    if taken:
        pytest.skip(f"port(s) {taken} already taken on this host; the docs use them as written")


def _finished(block: Block, run: Run) -> None:
    try:
        wait_until(lambda: run.proc.poll() is not None, BLOCK_TIMEOUT_S, f"{block.id} to finish", interval=0.2)
    except AssertionError:
        raise AssertionError(f"{block.id} still running after {BLOCK_TIMEOUT_S} s:\n{run.output()}") from None
    assert run.proc.returncode == 0, f"{block.id} exited {run.proc.returncode}:\n{run.output()}"
    assert '{"error":' not in run.output(), f"{block.id} got an error answer:\n{run.output()}"


def _chat(port: int) -> bool:
    """Whether 127.0.0.1:port answers a chat completion for the model it lists; a 4xx fails at
    once (the servers are up and refuse), anything else is "not up yet"."""
    url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return False
    assert not 400 <= r.status_code < 500, f"{url} refused a chat completion for model {model!r}: {r.text}"
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def _serves(block: Block, run: Run) -> None:
    port = int(block.argument)

    def answered() -> bool:
        if run.proc.poll() not in (None, 0):
            raise AssertionError(f"{block.id} exited {run.proc.returncode}:\n{run.output()}")
        return _chat(port)

    try:
        wait_until(answered, BLOCK_TIMEOUT_S, f"{block.id} answering on {port}", interval=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{run.output()}") from None


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in ALL if b.kind != NEEDS], ids=lambda b: b.id)
def test_doc_block_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    if block.kind == SKIP:
        pytest.skip(f"{block.id}: {block.argument}")
    _ports_free(block.ports())
    with started(block, tmp_path) as run:
        (_serves if block.kind == SERVES else _finished)(block, run)


@pytest.fixture(scope="module")
def tandem_up_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    _ports_free({STACK_PORT})
    cwd = tmp_path_factory.mktemp("tandem-up")
    with started(STACK, cwd) as run:
        def up() -> bool:
            if run.proc.poll() is not None:
                raise AssertionError(f"tandem up exited {run.proc.returncode}:\n{run.output()}")
            return "Tandem is up" in run.output()

        wait_until(up, BLOCK_TIMEOUT_S, "tandem up serving", interval=0.5)
        yield
        for name, info in json.loads((cwd / "stack" / "stack.json").read_text()).items():
            if name != "router":  # what the blocks did leaves every worker's KV pool whole
                pool = httpx.get(info["url"] + "/debug/pool", timeout=30).json()
                assert pool["whole"] in (True, None), (name, pool)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in ALL if b.kind == NEEDS], ids=lambda b: b.id)
def test_doc_block_against_tandem_up(block: Block, tandem_up_tiny: None, tmp_path: Path) -> None:
    with started(block, tmp_path) as run:
        _finished(block, run)
