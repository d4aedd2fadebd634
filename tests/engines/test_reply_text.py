"""A reply's text as it is decoded: incremental detokenizing and stop strings in O(reply)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convo.engines.local.replytext import IncrementalDecoder, StopMatcher
from convo.messages import user
from convo.models.generation import FinishReason


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=60),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4),
    cuts=st.lists(st.integers(1, 7), max_size=60),
)
def test_stop_matcher_finds_the_first_stop_wherever_the_pieces_split(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopMatcher(stops)
    pos, found = 0, None
    for n in [*cuts, len(text)]:
        if pos >= len(text):
            break
        found = matcher.feed(text[pos : pos + n])
        pos += n
        if found is not None:
            break
    assert found == _first_stop(text[:pos], stops)


def test_stop_matcher_keeps_only_a_stop_length_of_text() -> None:
    matcher = StopMatcher(["x" * 16_000] * 4)
    for _ in range(5_000):
        assert matcher.feed("word ") is None
    assert matcher.feed("x" * 16_000) == 5 * 5_000


class _CharTokenizer:
    """A tokenizer whose tokens are UTF-8 bytes: a character can span several tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "naïve café ½ — “q”", "日本語 🎉🎉 and more"])
def test_incremental_decoder_equals_one_decode_and_holds_back_broken_characters(text: str) -> None:
    tok = _CharTokenizer()
    dec = IncrementalDecoder(tok)
    pieces = [dec.add([b]) for b in text.encode()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == text


@pytest.mark.slow
def test_incremental_decoder_matches_the_default_models_tokenizer(smol_counter: Any) -> None:
    tok = smol_counter.tokenizer
    rng = random.Random(0)
    samples = [tok.encode("Hello world, ça va? 日本語 🎉 def f(x):\n    return x**2  # “quoted” ½")]
    samples += [[rng.randrange(tok.vocab_size) for _ in range(80)] for _ in range(30)]
    for ids in samples:
        dec = IncrementalDecoder(tok)
        out = "".join(dec.add([i]) for i in ids) + dec.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_long_stop_strings_cost_nothing_and_streams_stop_before_them(real_engine: Any) -> None:
    """Four 2,000-character stop strings: transformers' own stop-string tables took ~375 MiB
    and 1.6 s per 1,000 characters (issue 27 #1); the reply's own matcher takes neither."""
    psutil = pytest.importorskip("psutil")
    rss = psutil.Process(os.getpid()).memory_info().rss
    long_stops = [c * 2_000 for c in "qwxz"]
    out = real_engine.generate([user("Say hello.")], max_new_tokens=8, stop=long_stops)
    assert psutil.Process(os.getpid()).memory_info().rss - rss < 400 * 2**20
    assert out.text

    pieces: list[str] = []
    counted = real_engine.generate(
        [user("Count from 1 to 10, separated by commas.")],
        max_new_tokens=40,
        stop=["5", "x" * 3_000],
        on_text=pieces.append,
    )
    assert counted.finish_reason is FinishReason.STOP
    assert "".join(pieces) == counted.text  # nothing streamed past the stop string
    assert "5" not in "".join(pieces)
