"""Deterministic mode across roles, in bf16: prefill + decode over NIXL give the same tokens and
the same logprobs, bit for bit, as a colocated worker and the offline Engine: cold, chunked,
after radix hits on both sides (decode-side reuse), and concurrently. Pools whole after each."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from pd_client import pd_body, pd_generate, pd_post
from waits import wait_until
from worker_process import Worker, running

from tandem import Engine
from tandem.engine.kernels import cpu_kernels

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="deterministic mode runs on the CPU kernels")

SP = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
FLAGS = ("--dtype", "bfloat16", "--deterministic", "--page-size", "4", "--chunked-prefill-size", "32",
         "--max-total-tokens", "8192")
PROMPTS = ["hi", "one two three " * 21, "the quick brown fox jumps " * 9]


@pytest.fixture(scope="module")
def stack(model_path):
    model = model_path("tiny")
    pre = Worker.prefill(model, *FLAGS)
    dec = Worker.decode(model, *FLAGS, "--pd-local-prefill-threshold", "0", peers=[pre])
    col = Worker.colocated(model, *FLAGS)
    with running(pre, dec, col):
        yield pre, dec, col


@pytest.fixture(autouse=True)
def pools_whole(stack):
    yield
    for w in stack:
        assert w.pool()["whole"], w.output()


def _bits(reply: dict) -> tuple:
    return tuple(reply["output_ids"]), tuple(lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"])


def _body(text: str) -> dict:
    return {"text": text, "sampling_params": SP, "return_logprob": True}


def test_pd_equals_colocated_and_the_engine_bit_for_bit(stack, model_path) -> None:
    pre, dec, col = stack
    pd = [_bits(pd_generate(pre, dec, _body(p))) for p in PROMPTS]
    assert pd == [_bits(col.post("/generate", _body(p)).json()) for p in PROMPTS]
    with Engine(str(model_path("tiny")), dtype="bfloat16", deterministic=True, disable_radix_cache=True) as eng:
        alone = [eng.generate([p], {**SP, "return_logprob": True})[0] for p in PROMPTS]
    assert [t for t, _ in pd] == [tuple(o["token_ids"]) for o in alone]
    assert [lp for _, lp in pd] == [tuple(o["meta"]["logprobs"]) for o in alone]


def test_radix_hits_and_concurrency_change_no_bit(stack) -> None:
    pre, dec, col = stack
    base = "shared system prompt for every turn of this chat " * 6
    turn = base + " and now the second question"
    cold = _bits(col.post("/generate", _body(turn)).json())
    pd_generate(pre, dec, _body(base))  # both sides now hold the base
    assert _bits(pd_generate(pre, dec, _body(turn))) == cold
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda i: _bits(pd_generate(pre, dec, _body(turn if i % 2 else PROMPTS[1]))), range(8)))
    ref = _bits(col.post("/generate", _body(PROMPTS[1])).json())
    assert got == [cold if i % 2 else ref for i in range(8)]


def test_an_unseeded_chat_repeats_its_answer_and_choices_differ(stack) -> None:
    """The README's tour asks through the openai client with its default temperature (1) and no seed."""
    pre, dec, col = stack
    body = {"model": "tiny", "max_tokens": 12, "n": 2, "messages": [{"role": "user", "content": "capital of France?"}]}

    def ask(through_pd: bool) -> list[str]:
        r = pd_post(pre, dec, "/v1/chat/completions", body)[1] if through_pd else col.post("/v1/chat/completions",
                                                                                           body)
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]]

    first = ask(True)
    assert ask(True) == first and ask(False) == first
    assert first[0] != first[1]  # choice i draws with seed + i


def test_a_decode_not_in_the_mode_is_refused_at_the_handshake(stack, model_path) -> None:
    """Under a default-mode decode the guarantee would end after the first token, silently."""
    pre = stack[0]
    plain = tuple(f for f in FLAGS if f != "--deterministic")
    bad = Worker.decode(model_path("tiny"), *plain, peers=[pre])
    try:
        wait_until(lambda: "handshake refused: mismatch in deterministic" in bad.output(), 120,
                   "the decode's refused handshake", interval=0.2)
        bad.wait_listening()
        # To decode alone: the prefill half would wait out its 30 s bootstrap timeout for a claim
        # that never comes (test_pd_faults covers that side).
        d = bad.post("/generate", pd_body(pre, _body("mismatch")))
        assert d.status_code == 503 and "deterministic" in d.json()["error"]["message"], d.text
        assert bad.pool()["whole"], bad.output()
    finally:
        bad.stop()
