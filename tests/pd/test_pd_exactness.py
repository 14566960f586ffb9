"""Prefill + decode over NIXL give the same greedy tokens as colocated serving and the
offline Engine: chunked prefill, radix hits on both sides (decode-side reuse), 32
concurrent requests, logprobs, page_size 1 and 16. Every test ends with both pools whole,
checked from outside the processes."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from json_schemas import TOKEN_BUDGET, TOP, assert_valid
from pd_client import pd_generate, pd_post, pd_stats
from smoke import full
from worker_process import Worker, running

from tandem import Engine

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

SP = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
MAX_TOTAL = "8192"


def _flags(page_size: int) -> tuple[str, ...]:
    # Chunks of 64 tokens: a 300-token prompt goes to decode in 5 chunk sends.
    return ("--page-size", str(page_size), "--chunked-prefill-size", "64", "--max-total-tokens", MAX_TOTAL)


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def stack(request, model_path):
    model, flags = model_path("tiny"), _flags(request.param)
    pre = Worker.prefill(model, *flags)
    dec = Worker.decode(model, *flags, "--pd-local-prefill-threshold", "0", peers=[pre])
    col = Worker.colocated(model, *flags)
    with running(pre, dec, col):
        yield pre, dec, col, request.param


def _page16_unless_full(stack) -> None:
    """The heaviest cases run at page 16 in the smoke form (page 1 runs every other case)."""
    if stack[3] == 1 and not full():
        pytest.skip("--full only at page 1; the smoke form runs it at page 16")


@pytest.fixture(autouse=True)
def pools_whole(stack):
    yield
    for w in stack[:3]:
        assert w.pool()["whole"], w.output()


def _colocated(col: Worker, text: str, sp: dict = SP) -> dict:
    return col.post("/generate", {"text": text, "sampling_params": sp}).json()


def test_chunked_prompts_match_colocated_and_engine(stack, model_path) -> None:
    pre, dec, col, page_size = stack
    prompts = ["hi", "one two three " * 21, "a b c d e f g h " * 8, "the quick brown fox jumps " * 60]
    got = [pd_generate(pre, dec, {"text": p, "sampling_params": SP})["output_ids"] for p in prompts]
    assert got == [_colocated(col, p)["output_ids"] for p in prompts]
    if page_size == 16:
        with Engine(str(model_path("tiny")), dtype="float32", page_size=16, chunked_prefill_size=64,
                    max_total_tokens=int(MAX_TOTAL)) as eng:
            assert got == [r["token_ids"] for r in eng.generate(prompts, SP)]
    sends = pd_stats(pre)[0]["sends"]
    assert sends >= 5 + len(prompts)  # the long prompt went chunk by chunk


def test_radix_hits_on_both_sides_send_only_the_missing_pages(stack) -> None:
    pre, dec, col, page_size = stack
    base = "shared system prompt for every turn of this chat " * 12
    first = pd_generate(pre, dec, {"text": base, "sampling_params": SP})
    before = pd_stats(pre)[0]["kv_bytes_sent"], pd_stats(dec)[0]["reused_tokens"]
    turn = base + " and now the second question of the user"
    second = pd_generate(pre, dec, {"text": turn, "sampling_params": SP})
    assert first["output_ids"] == _colocated(col, base)["output_ids"]
    assert second["output_ids"] == _colocated(col, turn)["output_ids"]
    sent = pd_stats(pre)[0]["kv_bytes_sent"] - before[0]
    reused = pd_stats(dec)[0]["reused_tokens"] - before[1]
    n_base = first["meta_info"]["prompt_tokens"]
    assert reused >= n_base - 2 * page_size  # decode had the first turn cached
    assert sent < before[0] / 2  # only the new turn's pages moved


def test_32_concurrent_requests(stack) -> None:
    _page16_unless_full(stack)
    pre, dec, col, _ = stack
    prompts = [f"request number {i} " * (1 + i % 7) for i in range(32)]
    with cf.ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda p: pd_generate(pre, dec, {"text": p, "sampling_params": SP})["output_ids"],
                          prompts))
    assert got == [_colocated(col, p)["output_ids"] for p in prompts]


def test_logprobs_and_stop_on_the_first_token(stack) -> None:
    pre, dec, col, _ = stack
    body = {"text": "logprobs please", "sampling_params": {**SP, "max_new_tokens": 4},
            "return_logprob": True, "top_logprobs_num": 3}
    got = pd_generate(pre, dec, body)["meta_info"]
    ref = col.post("/generate", body).json()["meta_info"]
    assert [t for _, t, _ in got["output_token_logprobs"]] == [t for _, t, _ in ref["output_token_logprobs"]]
    for (a, _, _), (b, _, _) in zip(got["output_token_logprobs"], ref["output_token_logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert [[t for _, t, _ in row] for row in got["output_top_logprobs"]] == \
        [[t for _, t, _ in row] for row in ref["output_top_logprobs"]]
    one = pd_generate(pre, dec, {"text": "just one", "sampling_params": {**SP, "max_new_tokens": 1}})
    assert len(one["output_ids"]) == 1 and one["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_completions_and_chat_through_pd(stack) -> None:
    pre, dec, col, _ = stack
    body = {"model": "tiny", "prompt": "openai over pd", "max_tokens": 8, "temperature": 0}
    p, d = pd_post(pre, dec, "/v1/completions", body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["choices"][0]["text"] == col.post("/v1/completions", body).json()["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "n": 2}
    p, d = pd_post(pre, dec, "/v1/chat/completions", chat)
    assert d.status_code == 200, d.text
    ref = col.post("/v1/chat/completions", chat).json()
    assert [c["message"]["content"] for c in d.json()["choices"]] == [c["message"]["content"] for c in ref["choices"]]


def test_prefill_refuses_requests_without_a_room(stack) -> None:
    pre = stack[0]
    r = pre.post("/generate", {"text": "no room", "sampling_params": SP})
    assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]


def test_constrained_outputs_match_colocated(stack) -> None:
    """Prefill samples the first token under the grammar; decode's matcher accepts it and
    decoding goes on under the mask: the same tokens as colocated, and valid output."""
    import json
    import re

    import jsonschema

    _page16_unless_full(stack)
    pre, dec, col, _ = stack
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "n": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}}}
    regex = r"(yes|no): [a-z]{1,6}"
    cases = [({"max_new_tokens": 96, "temperature": 0.0, "json_schema": json.dumps(schema)}, "describe one item"),
             ({"max_new_tokens": 96, "temperature": 0.9, "seed": 5, "json_schema": json.dumps(schema)},
              "the quick brown fox jumps " * 20),
             ({"max_new_tokens": 32, "temperature": 1.0, "seed": 9, "regex": regex}, "answer")]
    for sp, prompt in cases:
        got = pd_generate(pre, dec, {"text": prompt, "sampling_params": sp})
        want = _colocated(col, prompt, sp)
        assert got["output_ids"] == want["output_ids"], sp
        if "json_schema" in sp:
            jsonschema.validate(json.loads(got["text"]), schema)
        else:
            assert re.fullmatch(regex, got["text"]), got["text"]


# Generated schemas through PD, several in flight at once (prefill batches their first tokens,
# decode their matchers): every answer validates and equals colocated serving's tokens.
@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(TOP, min_size=1, max_size=4), temperature=st.sampled_from([0.0, 0.8]))
def test_generated_schemas_through_pd_validate_and_match_colocated(stack, schemas, temperature) -> None:
    import json

    _page16_unless_full(stack)
    pre, dec, col, _ = stack
    bodies = [{"text": f"structured item {i} " * (1 + 3 * i), "sampling_params": {
        "max_new_tokens": TOKEN_BUDGET, "temperature": temperature, "seed": 21 + i, "json_schema": json.dumps(s)}}
        for i, s in enumerate(schemas)]
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        got = list(ex.map(lambda b: pd_generate(pre, dec, b), bodies))
    for out, schema in zip(got, schemas):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert_valid(out["text"], schema)
    assert [g["output_ids"] for g in got] == \
        [_colocated(col, b["text"], b["sampling_params"])["output_ids"] for b in bodies]
