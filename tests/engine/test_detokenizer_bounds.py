"""The incremental detokenizer's work per step is bounded whatever bytes the model writes.

Text that always ends in U+FFFD (a model writing lone UTF-8 continuation bytes) used to keep
the decode window open: every step re-decoded the whole answer, on the event loop and, with
stop strings, on the scheduler thread, and the final text came back empty. The work is
counted here (token ids handed to `decode`), never timed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.detokenizer import IncrementalDetokenizer, TextStream
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.output_processor import OutputProcessor

CONTINUATION = 0x80  # a UTF-8 continuation byte: invalid on its own, forever
SPECIAL = 256  # decodes to "" when special tokens are skipped
N = 3000
MOST_PER_DECODE = 16  # the window (6) + pending (4) + a few new tokens: a constant, never N


class ByteTokenizer:
    """One token per byte, decoded as byte-level BPE tokenizers do (invalid bytes -> U+FFFD);
    it counts the ids it is asked to decode."""

    def __init__(self) -> None:
        self.calls = 0
        self.decoded = 0
        self.most = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.decoded += len(ids)
        self.most = max(self.most, len(ids))
        return bytes(i for i in ids if i != SPECIAL).decode("utf-8", errors="replace")


def test_lone_continuation_bytes_cost_a_constant_per_step() -> None:
    tok = ByteTokenizer()
    stream = TextStream(tok)
    out = "".join(stream.feed([CONTINUATION], finished=k == N - 1) for k in range(N))
    assert tok.most <= MOST_PER_DECODE, tok.most
    assert tok.decoded <= 2 * MOST_PER_DECODE * N
    # Invalid for good: they come out as U+FFFD (all but a last few that could have been a
    # character cut off by the limit), streamed and whole alike.
    assert out == stream.text and N - 3 <= len(out) <= N and set(out) == {"\ufffd"}
    assert TextStream(ByteTokenizer()).feed([CONTINUATION] * N, finished=True) == out


def test_special_tokens_that_decode_to_nothing_keep_the_window_bounded() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([SPECIAL]) for _ in range(N)) == ""
    assert detok.step(list(b"ok"), final=True) == "ok"
    assert tok.most <= MOST_PER_DECODE, tok.most


def test_stop_strings_on_the_scheduler_thread_stay_bounded() -> None:
    """OutputProcessor.check_finished detokenizes each token when a request has stop strings."""
    tok = ByteTokenizer()
    proc = OutputProcessor(None, eos_ids=(), tokenizer=lambda: tok, emit=lambda outs: None)  # type: ignore[arg-type]
    params = SamplingParams.make(stop=["never"], max_new_tokens=10 * N)
    req = type("FakeReq", (), {"sampling_params": params, "output_ids": [], "detok": None})()
    for _ in range(N):
        req.output_ids.append(CONTINUATION)
        assert proc.check_finished(req, CONTINUATION) is None
    assert tok.most <= MOST_PER_DECODE, tok.most
    assert len(req.detok.text) >= N - 3


def test_a_character_cut_by_the_limit_is_still_left_out() -> None:
    emoji = "🎉".encode()
    for cut in (1, 2, 3):
        ids = [*b"ok ", *emoji[:cut]]
        stream = TextStream(ByteTokenizer())
        streamed = "".join(stream.feed([t], finished=k == len(ids) - 1) for k, t in enumerate(ids))
        assert streamed == TextStream(ByteTokenizer()).feed(ids, finished=True) == "ok "


PIECES = st.sampled_from([b"a", b" ", "é".encode(), "中".encode(), "🎉".encode(), b"\x80", b"\xf0", b"\xe4\xb8"])


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(PIECES, max_size=40), cuts=st.lists(st.integers(1, 6), min_size=1, max_size=60))
def test_any_bytes_in_any_chunks_stream_the_one_shot_text(pieces: list[bytes], cuts: list[int]) -> None:
    """Valid characters, invalid bytes and half characters mixed, fed in any chunk sizes:
    the streamed text is the one-shot text, and valid text is exactly what the bytes say."""
    ids = [b for piece in pieces for b in piece]
    stream, parts, i = TextStream(ByteTokenizer()), [], 0
    for n in cuts:
        if i >= len(ids):
            break
        parts.append(stream.feed(ids[i:i + n], finished=i + n >= len(ids)))
        i += n
    if i < len(ids):
        parts.append(stream.feed(ids[i:], finished=True))
    whole = TextStream(ByteTokenizer()).feed(ids, finished=True)
    assert "".join(parts) == whole
    decoded = bytes(ids).decode("utf-8", errors="replace")
    if not decoded.endswith("\ufffd"):
        assert whole == decoded


@pytest.mark.parametrize("skip", [True, False])
def test_the_tiny_models_tokenizer_writing_a_lone_byte_forever(model_path, skip: bool) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_path("tiny")))
    lone = next(i for i in range(hf.vocab_size) if hf.decode([i, i]) == "\ufffd\ufffd")
    calls: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(ids))
            return hf.decode(ids, skip_special_tokens=skip_special_tokens)

    stream = TextStream(Counting(), skip_special_tokens=skip)
    text = "".join(stream.feed([lone], finished=k == 499) for k in range(500))
    assert max(calls) <= MOST_PER_DECODE and len(text) >= 497


TEXT = st.lists(st.sampled_from([b"a", b"b", b" ", "é".encode(), "中".encode(), "🎉".encode()]), max_size=60)


@settings(max_examples=200, deadline=None)
@given(pieces=TEXT, stop=st.sampled_from(["ab", "b a", "中🎉", "é", "a中b"]),
       cuts=st.lists(st.integers(1, 6), min_size=1, max_size=60))
def test_a_stop_string_cuts_the_stream_where_the_one_shot_text_has_it(pieces: list[bytes], stop: str,
                                                                      cuts: list[int]) -> None:
    """The stream reads only the text's tail: a stop string split across chunks is still found."""
    ids = [b for piece in pieces for b in piece]
    text = bytes(ids).decode()
    stream, parts, i = TextStream(ByteTokenizer(), (stop,)), [], 0
    for n in [*cuts, len(ids)]:
        parts.append(stream.feed(ids[i:i + n], finished=i + n >= len(ids)))
        i += n
        if i >= len(ids):
            break
    want = text[: text.find(stop)] if stop in text else text
    assert "".join(parts) == stream.text == want
