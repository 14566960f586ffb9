"""The real model, SmolLM2-135M-Instruct (imported from its GGUF), in-process: the imported
directory, the chat template as the worker's front and the router render it, the EOS ids,
the incremental detokenizer on multi-byte text, and the offline Engine's greedy answers
against HF transformers token for token (fp32, normal and overlap loops).

The fixtures `smollm2` and `smollm2_reference` (tests/conftest.py) fetch and import the model
once into $TANDEM_HOME and compute HF's answers once per session.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tandem.engine.detokenizer import TextStream  # noqa: E402

MULTILINGUAL = "Paris 你好，世界！🎉🚀 ありがとう — naïve café 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧"


@pytest.fixture(scope="module")
def tok(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def test_imported_directory_is_portable(smollm2: Path) -> None:
    """What other engines and the router read: the template beside the tokenizer, the fast
    tokenizer by its portable class name, every file readable by others, the provenance."""
    from tandem.engine.modelgen.gguf_import import PROVENANCE, read_header

    cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["eos_token"] == "<|im_end|>"
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30
    for f in smollm2.iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f
    prov = json.loads((smollm2 / PROVENANCE).read_text())
    assert prov["dequantized"] and prov["tensor_types"]["Q4_1"] == 210
    if Path(prov["source"]).is_file():  # the GGUF's own template is the one the directory carries
        meta, _ = read_header(Path(prov["source"]))
        assert (smollm2 / "chat_template.jinja").read_text() == meta["tokenizer.chat_template"]


def test_front_and_router_render_chats_as_hf(smollm2: Path, smollm2_reference: list[dict], tok) -> None:
    """usage.prompt_tokens is the templated prompt's length only if both tokenizers in the
    request's path (the router's and the worker front's) produce HF's ids exactly."""
    from tandem.router.tokenizer import RouterTokenizer
    from tandem.server.tokens import Tokens

    front = Tokens(tok, {"max_context_len": 8192, "capacity_tokens": 8192, "vocab_size": 49152})
    router = RouterTokenizer(str(smollm2))
    for case in smollm2_reference:
        assert front.chat(case["messages"]) == case["prompt_ids"]
        assert router.chat(case["messages"]) == case["prompt_ids"]
    # The model's default system prompt comes in only when the chat has none.
    text = tok.decode(smollm2_reference[0]["prompt_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    assert "helpful AI assistant" not in tok.decode(smollm2_reference[1]["prompt_ids"])
    for prompt in (MULTILINGUAL, "a literal <|im_end|> in the text", " leading space"):
        assert router.encode(prompt) == front.encode(prompt) == tok(prompt)["input_ids"]


def test_every_eos_id_is_known(smollm2: Path, tmp_path: Path) -> None:
    """EOS ids come from config.json and generation_config.json, as HF `generate` reads them."""
    from tandem.engine.model_config import ModelConfig

    assert ModelConfig.from_pretrained(str(smollm2)).eos_token_ids == (2,)
    more = _with_eos(smollm2, tmp_path / "more", [2, 0, 1234])
    assert set(ModelConfig.from_pretrained(str(more)).eos_token_ids) == {2, 0, 1234}
    # <|im_end|> named by the tokenizer alone still ends a turn.
    only_tokenizer = _with_eos(smollm2, tmp_path / "tok", [1234], config_eos=1234)
    assert set(ModelConfig.from_pretrained(str(only_tokenizer)).eos_token_ids) == {1234, 2}


def _with_eos(model: Path, out: Path, eos: list[int], config_eos: int | None = None) -> Path:
    """The model with other EOS ids (every other file linked, not copied)."""
    out.mkdir()
    changed = {"generation_config.json": {"eos_token_id": eos}}
    if config_eos is not None:
        changed["config.json"] = {"eos_token_id": config_eos}
    for f in model.iterdir():
        if f.name in changed:
            (out / f.name).write_text(json.dumps({**json.loads(f.read_text()), **changed[f.name]}))
        else:
            os.symlink(f, out / f.name)
    return out


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=80))
def test_streamed_text_is_whole_at_every_chunking(tok, cuts: list[int]) -> None:
    """Any split of the ids into chunks streams exactly the one-shot text: no U+FFFD at a
    chunk border, nothing lost or doubled, in whatever sizes the scheduler delivers."""
    ids = tok(MULTILINGUAL, add_special_tokens=False)["input_ids"]
    stream, parts, i = TextStream(tok), [], 0
    for n in cuts:
        chunk, i = ids[i:i + n], i + n
        parts.append(stream.feed(chunk, finished=i >= len(ids)))
        if i >= len(ids):
            break
    else:
        parts.append(stream.feed(ids[i:], finished=True))
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == tok.decode(ids) == MULTILINGUAL


def test_a_character_cut_by_the_limit_is_left_out(tok) -> None:
    """The last token ends in the middle of an emoji's bytes (max_tokens cut it): the text
    stops before it rather than ending in U+FFFD, streamed and whole alike."""
    ids = tok("ok 🎉", add_special_tokens=False)["input_ids"]
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    stream = TextStream(tok)
    streamed = "".join(stream.feed([t], finished=k == cut - 1) for k, t in enumerate(ids[:cut]))
    assert streamed == TextStream(tok).feed(ids[:cut], finished=True) == "ok "


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_engine_greedy_equals_hf(engine, smollm2: Path, smollm2_reference: list[dict], overlap: bool) -> None:
    cases = smollm2_reference
    eng = engine(smollm2, disable_overlap_schedule=not overlap, max_total_tokens=4096)
    outs = eng.generate([c["prompt_ids"] for c in cases],
                        [{"temperature": 0, "max_new_tokens": c["max_tokens"]} for c in cases])
    streamed = "".join(part["text"] for part in eng.generate_stream(
        cases[4]["prompt_ids"], {"temperature": 0, "max_new_tokens": cases[4]["max_tokens"]}))
    for case, out in zip(cases, outs):
        assert out["token_ids"] == case["ids"], (case["messages"], out["text"], case["text"])
        assert out["text"] == case["text"] and "\ufffd" not in out["text"] and "<|im_end|>" not in out["text"]
        assert out["finish_reason"] == case["finish_reason"]
        assert out["meta"]["prompt_tokens"] == len(case["prompt_ids"])
    assert streamed == cases[4]["text"]


def test_any_eos_id_ends_the_answer(engine, smollm2: Path, smollm2_reference: list[dict], tmp_path: Path) -> None:
    """Make " Paris" an EOS id: the answer to the first question ends there, with `stop`."""
    case = smollm2_reference[0]
    paris = case["ids"][5]
    eng = engine(_with_eos(smollm2, tmp_path / "model", [2, paris]), max_total_tokens=4096)
    out = eng.generate(case["prompt_ids"], {"temperature": 0, "max_new_tokens": 20})[0]
    assert out["token_ids"] == case["ids"][:6] and out["finish_reason"] == "stop"
