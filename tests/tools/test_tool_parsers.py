"""Tool calls read out of replies in the three families' real formats, whole and streamed,
the template detection, and the validation of the request's tools."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convo.errors import ConfigError, MessageError
from convo.messages import Message, ToolCall
from convo.tools import (
    ContentDelta,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedReply,
    ToolCallDelta,
    ToolChoiceMode,
    ToolLimits,
    ToolParser,
    ToolSpecError,
    detect_parser,
    get_parser,
    new_call_id,
    parse_tool_request,
)
from convo.tools.canonical_json import JsonScanner
from convo.tools.history import mistral_call_id, template_messages

HERMES, LLAMA, MISTRAL = HermesParser(), Llama3JsonParser(), MistralParser()


def canonical(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def seeded() -> random.Random:
    return random.Random(1234)


def ids(n: int) -> list[str]:
    rng = seeded()
    return [new_call_id(rng) for _ in range(n)]


# -- recorded replies ----------------------------------------------------------------------
# Written in each family's format as its chat template renders an assistant tool call
# (Qwen2.5: '<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>'; Llama 3.1:
# '{"name": ..., "parameters": ...}', '<|python_tag|>' in ipython mode; Mistral v0.3:
# '[TOOL_CALLS] [{"name": ..., "arguments": ...}]').

NESTED_ARGS = {
    "query": "SELECT * FROM t WHERE a = \"{x}\" AND b = '}'",
    "filters": {"range": [1, 2.5, -3], "tags": ["a{", "}b", "[c]"], "deep": {"ok": True, "none": None}},
    "path": "C:\\temp\\new",
}
UNICODE_ARGS = {"city": "Zürich", "greeting": "こんにちは 👋", "quote": "«ça»"}

# name -> (parser, text, expected content, expected [(name, arguments value)], invalid?)
RECORDED: dict[str, tuple[ToolParser, str, str, list[tuple[str, Any]], bool]] = {
    "hermes_one_call": (
        HERMES,
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Paris, France", '
        '"unit": "celsius"}}\n</tool_call>',
        "",
        [("get_current_temperature", {"location": "Paris, France", "unit": "celsius"})],
        False,
    ),
    "hermes_two_parallel_calls": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Berlin"})],
        False,
    ),
    "hermes_text_before_call": (
        HERMES,
        "Let me check the weather for you.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check the weather for you.",
        [("get_weather", {"city": "Paris"})],
        False,
    ),
    "hermes_nested_braces_in_strings": (
        HERMES,
        "<tool_call>\n"
        + json.dumps({"name": "run_query", "arguments": NESTED_ARGS}, indent=2)
        + "\n</tool_call>",
        "",
        [("run_query", NESTED_ARGS)],
        False,
    ),
    "hermes_unicode_escaped": (
        HERMES,
        "<tool_call>\n"
        + json.dumps({"name": "greet", "arguments": UNICODE_ARGS})  # \\u escapes, as ensure_ascii writes
        + "\n</tool_call>",
        "",
        [("greet", UNICODE_ARGS)],
        False,
    ),
    "hermes_arguments_before_name": (  # Hermes 2 Pro's own examples put "arguments" first
        HERMES,
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        "",
        [("get_stock_fundamentals", {"symbol": "TSLA"})],
        False,
    ),
    "hermes_closing_tag_cut_off": (
        HERMES,
        '<tool_call>\n{"name": "now", "arguments": {}}\n',
        "",
        [("now", {})],
        False,
    ),
    "hermes_text_after_call": (
        HERMES,
        'Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nOne moment.',
        "Checking.\nOne moment.",
        [("now", {})],
        False,
    ),
    "hermes_invalid_json": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {\'city\': \'Paris\'}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {\'city\': \'Paris\'}}\n</tool_call>',
        [],
        True,
    ),
    "hermes_cut_inside_arguments": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        [],
        True,
    ),
    "hermes_marker_inside_plain_text": (
        HERMES,
        "Qwen wraps each call in a <tool_call> tag, like an XML element.",
        "Qwen wraps each call in a <tool_call> tag, like an XML element.",
        [],
        True,
    ),
    "hermes_no_call": (
        HERMES,
        "The capital of France is Paris. {not a call} </tool_call>",
        "The capital of France is Paris. {not a call} </tool_call>",
        [],
        False,
    ),
    "llama_one_call": (
        LLAMA,
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
        False,
    ),
    "llama_python_tag": (
        LLAMA,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}',
        "",
        [("get_weather", {"city": "Zürich"})],
        False,
    ),
    "llama_two_parallel_calls": (
        LLAMA,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        False,
    ),
    "llama_nested_and_arguments_key": (
        LLAMA,
        "\n" + json.dumps({"name": "run_query", "arguments": NESTED_ARGS}),
        "",
        [("run_query", NESTED_ARGS)],
        False,
    ),
    "llama_invalid_json": (
        LLAMA,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris",}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris",}}',
        [],
        True,
    ),
    "llama_json_with_a_name_is_not_a_call": (
        LLAMA,
        '{"name": "Alice", "age": 31}',
        '{"name": "Alice", "age": 31}',
        [],
        False,
    ),
    "llama_broken_json_without_marker_is_text": (
        LLAMA,
        '{"name": "Alice", age: 31}',
        '{"name": "Alice", age: 31}',
        [],
        False,
    ),
    "llama_type_key_first": (  # Llama 3.2 1B/3B often add "type": "function"
        LLAMA,
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
        False,
    ),
    "llama_python_tag_without_parameters": (
        LLAMA,
        '<|python_tag|>{"name": "get_weather"}',
        '<|python_tag|>{"name": "get_weather"}',
        [],
        True,
    ),
    "llama_json_answer_is_not_a_call": (
        LLAMA,
        '{"capital": "Paris", "country": "France"}',
        '{"capital": "Paris", "country": "France"}',
        [],
        False,
    ),
    "llama_call_shaped_json_inside_text": (
        LLAMA,
        'A call looks like {"name": "get_weather", "parameters": {"city": "Paris"}}.',
        'A call looks like {"name": "get_weather", "parameters": {"city": "Paris"}}.',
        [],
        False,
    ),
    "llama_text_after_call": (
        LLAMA,
        '{"name": "get_weather", "parameters": {"city": "Paris"}} I called the tool.',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} I called the tool.',
        [],
        True,
    ),
    "llama_no_call": (LLAMA, "Paris is the capital of France.", "Paris is the capital of France.", [], False),
    "mistral_one_call": (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
        '"format": "celsius"}}]',
        "",
        [("get_current_weather", {"location": "San Francisco, CA", "format": "celsius"})],
        False,
    ),
    "mistral_two_parallel_calls": (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "write_file", "arguments": {"path": "a.txt", "content": "a"}}, '
        '{"name": "write_file", "arguments": {"path": "b.txt", "content": "b"}}]',
        "",
        [
            ("write_file", {"path": "a.txt", "content": "a"}),
            ("write_file", {"path": "b.txt", "content": "b"}),
        ],
        False,
    ),
    "mistral_text_before_call": (
        MISTRAL,
        'I\'ll create the file.\n[TOOL_CALLS] [{"name": "write_file", "arguments": '
        '{"path": "/tmp/test.txt", "content": "hello world"}}]',
        "I'll create the file.",
        [("write_file", {"path": "/tmp/test.txt", "content": "hello world"})],
        False,
    ),
    "mistral_nested_unicode_and_history_id": (  # the v0.3 template renders an "id" in history
        MISTRAL,
        "[TOOL_CALLS]"
        + json.dumps(
            [{"name": "run_query", "arguments": {**NESTED_ARGS, **UNICODE_ARGS}, "id": "a1b2c3d4e"}]
        ),
        "",
        [("run_query", {**NESTED_ARGS, **UNICODE_ARGS})],
        False,
    ),
    "mistral_invalid_json": (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "write_file", "arguments": {"path": "a.txt" "content": "a"}}]',
        '[TOOL_CALLS] [{"name": "write_file", "arguments": {"path": "a.txt" "content": "a"}}]',
        [],
        True,
    ),
    "mistral_marker_inside_plain_text": (
        MISTRAL,
        "Mistral models start a call with [TOOL_CALLS] and then a JSON list.",
        "Mistral models start a call with [TOOL_CALLS] and then a JSON list.",
        [],
        True,
    ),
    "mistral_no_call": (MISTRAL, "No tool is needed: 2 + 2 = 4.", "No tool is needed: 2 + 2 = 4.", [], False),
}


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_recorded_replies_parse_as_expected(case: str) -> None:
    parser, text, content, calls, invalid = RECORDED[case]
    reply = parser.parse(text, rng=seeded())
    assert reply.content == content
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == calls
    assert [c.arguments for c in reply.tool_calls] == [canonical(args) for _, args in calls]
    assert [c.id for c in reply.tool_calls] == ids(len(calls))
    assert reply.finish_reason == ("tool_calls" if calls else "stop")
    assert (reply.invalid is not None) == invalid
    if calls:  # the calls fit the message model the rest of convo uses
        Message(role="assistant", content=reply.content, tool_calls=reply.tool_calls)


def test_invalid_reasons_say_what_went_wrong() -> None:
    assert "expected a key" in (HERMES.parse(RECORDED["hermes_invalid_json"][1]).invalid or "")
    assert "ended inside tool call 1" in (
        HERMES.parse(RECORDED["hermes_cut_inside_arguments"][1]).invalid or ""
    )
    assert "no 'parameters' or 'arguments'" in (LLAMA.parse('<|python_tag|>{"name": "f"}').invalid or "")
    assert "must be a JSON object" in (
        HERMES.parse('<tool_call>{"name": "f", "arguments": "x"}').invalid or ""
    )
    dup = HERMES.parse('<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>')
    assert 'duplicate key "a"' in (dup.invalid or "")
    second = MISTRAL.parse('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": 3, "arguments": {}}]')
    assert second.invalid == "tool call 2: the call's 'name' must be a string"
    nan = HERMES.parse('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>')
    assert "tool call 1:" in (nan.invalid or "")


def test_lone_surrogate_in_arguments_is_invalid_not_a_crash() -> None:
    reply = HERMES.parse('<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>')
    assert reply.tool_calls == () and "lone surrogate" in (reply.invalid or "")
    pair = HERMES.parse('<tool_call>{"name": "f", "arguments": {"s": "\\ud83d\\ude00"}}</tool_call>')
    assert pair.tool_calls[0].arguments == '{"s":"😀"}'


def test_allowed_names_refuse_a_function_that_was_not_offered() -> None:
    text = RECORDED["hermes_two_parallel_calls"][1]
    assert HERMES.parse(text, allowed_names={"get_weather"}).finish_reason == "tool_calls"
    refused = HERMES.parse(text, allowed_names={"get_time"})
    assert refused.content == text and refused.tool_calls == ()
    assert refused.invalid == "the model called 'get_weather', which is not among the offered tools"
    stream = HERMES.stream(allowed_names={"get_time"})
    deltas = stream.feed(text) + stream.close()
    assert (
        not stream.sent_tool_calls and "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == text
    )


def test_call_ids_look_like_openai_ids_and_follow_the_rng() -> None:
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id())
    assert new_call_id() != new_call_id()
    assert new_call_id(random.Random(7)) == new_call_id(random.Random(7))


# -- streaming -----------------------------------------------------------------------------


def stream_pieces(
    parser: ToolParser, pieces: list[str], **kwargs: Any
) -> tuple[list[Any], ParsedReply, bool]:
    stream = parser.stream(rng=seeded(), **kwargs)
    deltas: list[Any] = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.close()
    return deltas, stream.finish(), stream.sent_tool_calls


def test_stream_deltas_exactly_for_a_hermes_reply_in_token_sized_pieces() -> None:
    pieces = ["Sure", ",", " let", " me", " check", ".\n", "<tool_call>", "\n", '{"', "name", '":', ' "',
              "get", "_weather", '",', ' "', "arguments", '":', ' {"', "city", '":', ' "', "Par", "is",
              '",', ' "', "days", '":', " ", "3", "}}", "\n", "</tool_call>"]  # fmt: skip
    deltas, reply, sent = stream_pieces(HERMES, pieces)
    (cid,) = ids(1)
    assert deltas == [
        ContentDelta("Sure"),
        ContentDelta(","),
        ContentDelta(" let"),
        ContentDelta(" me"),
        ContentDelta(" check"),
        ContentDelta("."),  # "\n" before the marker is held, then dropped
        ToolCallDelta(0, cid, "get_weather", ""),  # once "arguments" is known
        ToolCallDelta(0, None, None, "{"),  # a key goes out when it is complete
        ToolCallDelta(0, None, None, '"city":'),
        ToolCallDelta(0, None, None, '"'),  # string contents go out as they come
        ToolCallDelta(0, None, None, "Par"),
        ToolCallDelta(0, None, None, "is"),
        ToolCallDelta(0, None, None, '",'),
        ToolCallDelta(0, None, None, '"days":'),
        ToolCallDelta(0, None, None, "3}"),  # a number goes out when it is complete
    ]
    assert sent and reply == HERMES.parse("".join(pieces), rng=seeded())
    assert reply.tool_calls == (ToolCall(id=cid, name="get_weather", arguments='{"city":"Paris","days":3}'),)
    assert deltas[6].to_openai() == {
        "tool_calls": [
            {"index": 0, "id": cid, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ]
    }
    assert deltas[7].to_openai() == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}


def test_stream_deltas_exactly_for_parallel_mistral_calls() -> None:
    pieces = ["[TOOL_CALLS]", " [", '{"name": "a", "arguments": {"x": 1}}', ", ",
              '{"arguments": {"y": [true]}, ', '"name": "b"}', "]"]  # fmt: skip
    deltas, reply, _ = stream_pieces(MISTRAL, pieces)
    first, second = ids(2)
    assert deltas == [
        ToolCallDelta(0, first, "a", ""),
        ToolCallDelta(0, None, None, '{"x":1}'),
        ToolCallDelta(1, second, "b", ""),  # the name came after the arguments: they were held
        ToolCallDelta(1, None, None, '{"y":[true]}'),
    ]
    assert [c.arguments for c in reply.tool_calls] == ['{"x":1}', '{"y":[true]}']


def test_a_partial_marker_is_held_and_released_as_text_when_it_is_not_one() -> None:
    stream = HERMES.stream()
    assert stream.feed("a <tool") == [ContentDelta("a")]
    assert stream.feed("box> b") == [ContentDelta(" <toolbox> b")]
    assert stream.close() == [] and stream.finish() == ParsedReply(content="a <toolbox> b")
    end = MISTRAL.stream()
    assert end.feed("ends with [TOOL_") == [ContentDelta("ends with")]
    assert end.close() == [ContentDelta(" [TOOL_")]


def test_an_invalid_reply_streams_the_unsent_text_and_says_calls_went_out() -> None:
    text = RECORDED["hermes_invalid_json"][1]
    deltas, reply, sent = stream_pieces(HERMES, [text[:40], text[40:]])
    assert sent  # the header went out before the bad quote: the server must end with an error
    assert reply == HERMES.parse(text, rng=seeded()) and reply.invalid is not None
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)).endswith(
        "'city': 'Paris'}}\n</tool_call>"
    )


def test_hold_calls_streams_an_invalid_reply_as_exactly_its_text() -> None:
    text = "Checking.\n" + RECORDED["hermes_invalid_json"][1]
    deltas, reply, sent = stream_pieces(HERMES, list(text), hold_calls=True)
    assert not sent and all(isinstance(d, ContentDelta) for d in deltas)
    assert "".join(d.text for d in deltas) == text == reply.content
    valid = RECORDED["hermes_text_before_call"][1]
    held = HERMES.stream(rng=seeded(), hold_calls=True)
    assert held.feed(valid) == [ContentDelta("Let me check the weather for you.")]
    assert [type(d) for d in held.close()] == [ToolCallDelta, ToolCallDelta]


def test_feed_after_close_and_finish_before_close_are_refused() -> None:
    stream = HERMES.stream()
    with pytest.raises(RuntimeError, match="close"):
        stream.finish()
    stream.close()
    with pytest.raises(RuntimeError, match="after close"):
        stream.feed("x")


def check_deltas(deltas: list[Any], reply: ParsedReply, *, sent: bool) -> None:
    """The deltas tell the same reply as the result: content, then each call's header
    (index, id, name, no arguments) before its fragments, which join to its arguments."""
    text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    if reply.invalid is None or not sent:
        assert text == reply.content
    if reply.invalid is not None:
        return
    assert sent == bool(reply.tool_calls)
    seen: dict[int, list[str]] = {}
    for d in calls:
        if d.index not in seen:
            assert d.index == len(seen) and d.arguments_fragment == ""
            assert (d.id, d.name) == (reply.tool_calls[d.index].id, reply.tool_calls[d.index].name)
            seen[d.index] = []
        else:
            assert d.id is None and d.name is None and d.arguments_fragment
            assert d.index == len(seen) - 1  # calls do not interleave
            seen[d.index].append(d.arguments_fragment)
    assert ["".join(f) for f in seen.values()] == [c.arguments for c in reply.tool_calls]


@st.composite
def split_recorded(draw: st.DrawFn) -> tuple[str, list[str]]:
    case = draw(st.sampled_from(sorted(RECORDED)))
    text = RECORDED[case][1]
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return case, [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_recorded(), st.booleans())
def test_streaming_any_split_gives_the_whole_text_result(sample: tuple[str, list[str]], hold: bool) -> None:
    case, pieces = sample
    parser = RECORDED[case][0]
    deltas, reply, sent = stream_pieces(parser, pieces, hold_calls=hold)
    assert reply == parser.parse("".join(pieces), rng=seeded())
    check_deltas(deltas, reply, sent=sent)
    if hold and reply.invalid is not None:
        assert not sent


FRAGMENTS = (
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<tool", "[TOOL", "{", "}", "[", "]",
    '"name"', '"arguments"', '"parameters"', ":", ",", ";", " ", "\n", '"f"', "1", "x", "\\", '"',
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    st.sampled_from([HERMES, LLAMA, MISTRAL]),
    st.lists(st.integers(0, 200), max_size=8),
    st.booleans(),
)
def test_any_mix_of_markers_and_json_streams_like_the_whole_text(
    fragments: list[str], parser: ToolParser, cuts: list[int], hold: bool
) -> None:
    text = "".join(fragments)
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    deltas, reply, sent = stream_pieces(parser, pieces, hold_calls=hold)
    assert reply == parser.parse(text, rng=seeded())
    check_deltas(deltas, reply, sent=sent)
    if not reply.tool_calls:
        assert reply.content == text


# -- arguments are canonical JSON, whatever the model's spacing and escapes ----------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), json_values, max_size=5),
    st.sampled_from([None, 0, 2]),
    st.booleans(),
    st.sampled_from([HERMES, LLAMA, MISTRAL]),
    st.integers(1, 7),
)
def test_arguments_are_the_canonical_json_of_what_the_model_wrote(
    args: dict[str, Any], indent: int | None, ascii_only: bool, parser: ToolParser, step: int
) -> None:
    key = "parameters" if parser is LLAMA else "arguments"
    body = json.dumps({"name": "f", key: args}, indent=indent, ensure_ascii=ascii_only)
    text = {HERMES: f"<tool_call>\n{body}\n</tool_call>", LLAMA: body, MISTRAL: f"[TOOL_CALLS] [{body}]"}[
        parser
    ]
    reply = parser.parse(text)
    if any(isinstance(v, str) and re.search("[\ud800-\udfff]", v) for v in _strings(args)):
        assert reply.invalid is not None  # lone surrogates are refused
        return
    assert reply.invalid is None, reply.invalid
    (call,) = reply.tool_calls
    assert call.arguments == canonical(json.loads(body)[key])
    deltas, streamed, sent = stream_pieces(parser, [text[i : i + step] for i in range(0, len(text), step)])
    check_deltas(deltas, streamed, sent=sent)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _json_loads_strict(text: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(name)

    def finite(token: str) -> float:
        value = float(token)
        if not math.isfinite(value):
            raise ValueError(token)
        return value

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate")
        return dict(pairs)

    value = json.loads(text, parse_constant=no_constant, parse_float=finite, object_pairs_hook=unique)
    canonical(value).encode("utf-8")  # lone surrogates
    return value


def _scan(text: str) -> str | None:
    scanner = JsonScanner()
    out = []
    for ch in text:
        if not scanner.feed(ch) and (scanner.error is not None or not ch.isspace()):
            return None
        out.append(scanner.take())
    scanner.finish()
    out.append(scanner.take())
    return "".join(out) if scanner.done and scanner.error is None else None


@settings(max_examples=400, deadline=None)
@given(json_values, st.data())
def test_the_scanner_accepts_exactly_what_strict_json_loads_accepts(value: Any, data: st.DataObject) -> None:
    text = json.dumps(
        value, indent=data.draw(st.sampled_from([None, 1])), ensure_ascii=data.draw(st.booleans())
    )
    if data.draw(st.booleans()) and text:  # break it: drop, repeat or replace one character
        i = data.draw(st.integers(0, len(text) - 1))
        edit = data.draw(st.sampled_from(["", text[i] * 2, ",", "}", '"', "\\", "x", "1", "e", "\ud800"]))
        text = text[:i] + edit + text[i + 1 :]
    try:
        expected: str | None = canonical(_json_loads_strict(text))
    except (ValueError, UnicodeEncodeError, RecursionError):
        expected = None
    assert _scan(text) == expected


# -- picking a parser ----------------------------------------------------------------------

# Short excerpts of the real chat templates (tokenizer_config.json "chat_template").
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n"
)
LLAMA31_TEMPLATE = (
    "{%- if builtin_tools is defined or tools is not none %}\n"
    '    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.' }}\n"
    '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
    "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n            {{- '\"parameters\": ' }}\n"
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
)
LLAMA_JSON_TEMPLATE = LLAMA31_TEMPLATE.replace('"<|python_tag|>" + ', "")  # vLLM's JSON-only variant
MISTRAL_V03_TEMPLATE = (
    '            {{- "[AVAILABLE_TOOLS] [" }}\n'
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    '        {{- "[TOOL_CALLS] [" }}\n        {%- for tool_call in message.tool_calls %}\n'
    "            {%- set out = tool_call.function|tojson %}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    '                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA_JSON_TEMPLATE, "llama3_json"),
        (MISTRAL_V03_TEMPLATE, "mistral"),
        (SMOLLM2_TEMPLATE, None),
        (MISTRAL_V03_TEMPLATE.replace('"[TOOL_CALLS] ["', '"[TOOL_CALLS]" + name + "[ARGS]"'), None),
        ("", None),
        (None, None),
    ],
)
def test_detect_parser_reads_the_template(template: str | None, expected: str | None) -> None:
    parser = detect_parser(template)
    assert (parser.name if parser else None) == expected
    if parser is not None:
        assert isinstance(parser, ToolParser)


def test_get_parser_by_name_and_unknown_names() -> None:
    assert [get_parser(n).name for n in ("hermes", "llama3_json", "mistral")] == [
        "hermes",
        "llama3_json",
        "mistral",
    ]
    with pytest.raises(ConfigError, match="hermes, llama3_json, mistral"):
        get_parser("pythonic")


# -- the request's tools -------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def fn(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


def test_a_valid_request_and_openai_defaults() -> None:
    req = parse_tool_request([WEATHER, fn(name="now")])
    assert req.choice.mode is ToolChoiceMode.AUTO and req.parallel_tool_calls
    assert req.names == {"get_weather", "now"} and req.calls_allowed
    now = {"name": "now", "parameters": {"type": "object", "properties": {}}}
    assert req.to_template() == [WEATHER, {"type": "function", "function": now}]
    empty = parse_tool_request(None)
    assert (
        empty.choice.mode is ToolChoiceMode.NONE and not empty.calls_allowed and empty.to_template() is None
    )
    named = parse_tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert (named.choice.mode, named.choice.name, named.parallel_tool_calls) == (
        ToolChoiceMode.FUNCTION,
        "get_weather",
        False,
    )
    assert named.choice.to_openai() == {"type": "function", "function": {"name": "get_weather"}}
    assert parse_tool_request([WEATHER], "none").to_template() is None


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "field", "words"),
    [
        ("get_weather", None, None, "tools", "list"),
        ([42], None, None, "tools[0]", "object"),
        ([{"type": "retrieval"}], None, None, "tools[0].type", "'function'"),
        ([{"type": "function"}], None, None, "tools[0].function", "object"),
        ([fn(name="get weather")], None, None, "tools[0].function.name", "1 to 64"),
        ([fn(name="x" * 65)], None, None, "tools[0].function.name", "1 to 64"),
        ([WEATHER, fn(name="")], None, None, "tools[1].function.name", "1 to 64"),
        ([fn(description=3)], None, None, "tools[0].function.description", "string"),
        ([fn(parameters=[])], None, None, "tools[0].function.parameters", "JSON Schema object"),
        ([fn(parameters={"type": "array"})], None, None, "tools[0].function.parameters.type", "'object'"),
        ([fn(strict="yes")], None, None, "tools[0].function.strict", "boolean"),
        ([fn(), fn()], None, None, "tools[1].function.name", "offered twice"),
        ([WEATHER], "sometimes", None, "tool_choice", "'auto', 'none', 'required'"),
        ([], "required", None, "tool_choice", "no tools"),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "now"}},
            None,
            "tool_choice.function.name",
            "not among",
        ),
        ([WEATHER], {"type": "tool"}, None, "tool_choice.type", "'function'"),
        ([WEATHER], {"type": "function"}, None, "tool_choice.function.name", "offered tool"),
        ([WEATHER], 7, None, "tool_choice", "string or an object"),
        ([WEATHER], None, "true", "parallel_tool_calls", "boolean"),
    ],
)
def test_malformed_fields_are_refused_by_name(
    tools: Any, choice: Any, parallel: Any, field: str, words: str
) -> None:
    with pytest.raises(ToolSpecError) as info:
        parse_tool_request(tools, choice, parallel)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and words in str(info.value)
    assert isinstance(info.value, MessageError)


def test_limits_on_tool_count_and_schema_size_sit_exactly_on_the_edge() -> None:
    limits = ToolLimits(max_tools=2, max_schema_bytes=len(canonical(WEATHER["function"]).encode()))
    assert len(parse_tool_request([WEATHER, fn()], limits=limits).tools) == 2
    with pytest.raises(ToolSpecError, match="3 tools; at most 2"):
        parse_tool_request([WEATHER, fn(), fn(name="g")], limits=limits)
    bigger = {**WEATHER, "function": {**WEATHER["function"], "description": "Weather of a city!"}}
    with pytest.raises(ToolSpecError, match="at most") as info:
        parse_tool_request([bigger], limits=limits)
    assert info.value.field == "tools[0].function"
    with pytest.raises(ConfigError):
        ToolLimits(max_tools=0)


def test_request_check_names_the_broken_rule() -> None:
    auto = parse_tool_request([WEATHER, fn(name="now")], parallel_tool_calls=False)
    assert auto.check(["get_weather"]) is None and auto.check([]) is None
    assert "not among" in (auto.check(["delete_all"]) or "")
    assert "parallel_tool_calls is false" in (auto.check(["now", "now"]) or "")
    assert "'required'" in (parse_tool_request([WEATHER], "required").check([]) or "")
    named = parse_tool_request([WEATHER, fn(name="now")], {"type": "function", "function": {"name": "now"}})
    assert named.check(["now"]) is None and "names 'now'" in (named.check(["get_weather"]) or "")
    assert "'none'" in (parse_tool_request([WEATHER], "none").check(["get_weather"]) or "")


# -- the history, rendered back the way the templates render a call -----------------------

# The assistant tool-call parts of the real templates (Qwen2.5, Llama 3.1, Mistral v0.3).
RENDER_CALLS = {
    "hermes": (
        "{%- for message in messages %}{{- message.content }}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
        '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
        "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}{%- endfor %}"
    ),
    "llama3_json": (
        "{%- for message in messages %}{%- set tool_call = message.tool_calls[0].function %}"
        "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
        "{{- tool_call.arguments | tojson }}{{- '}' }}{%- endfor %}"
    ),
    "mistral": (
        "{%- for message in messages %}{{- '[TOOL_CALLS] [' }}"
        "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
        "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
        "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
        "{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
        "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' }}{%- endif %}"
        "{%- endfor %}{%- endfor %}"
    ),
}


def render(template: str, conversation: list[dict[str, Any]]) -> str:
    jinja2 = pytest.importorskip("jinja2.sandbox")

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)  # as HF
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=conversation)


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_a_parsed_call_renders_back_as_the_model_wrote_it(family: str) -> None:
    parser = get_parser(family)
    wrote = {
        "hermes": RECORDED["hermes_nested_braces_in_strings"][1],
        "llama3_json": RECORDED["llama_nested_and_arguments_key"][1].replace('"arguments"', '"parameters"'),
        "mistral": RECORDED["mistral_nested_unicode_and_history_id"][1],
    }[family]
    reply = parser.parse(wrote, rng=seeded())
    message = Message(role="assistant", content=reply.content, tool_calls=reply.tool_calls)
    call_id = mistral_call_id if family == "mistral" else None
    rendered = render(RENDER_CALLS[family], template_messages([message], call_id=call_id))
    again = parser.parse(rendered, rng=seeded())
    assert again.invalid is None and again.tool_calls == reply.tool_calls


def test_string_arguments_would_be_quoted_twice_and_long_ids_refused_by_mistral() -> None:
    reply = HERMES.parse(RECORDED["hermes_one_call"][1], rng=seeded())
    message = Message(role="assistant", content="", tool_calls=reply.tool_calls)
    twice = render(RENDER_CALLS["hermes"], [message.to_dict()])  # arguments as the JSON string
    assert "must be a JSON object" in (HERMES.parse(twice).invalid or "")
    with pytest.raises(ValueError, match="length 9"):
        render(RENDER_CALLS["mistral"], template_messages([message]))


def test_template_messages_map_ids_in_calls_and_results_alike() -> None:
    call = ToolCall(id="call_8fKd0sl2mQpXz0aB4cRtYu1v", name="f", arguments='{"a": [1]}')
    odd = ToolCall(id="c2", name="g", arguments="not json")
    history = [
        Message(role="assistant", content="", tool_calls=(call, odd)),
        Message(role="tool", content="42", tool_call_id=call.id),
    ]
    rendered = template_messages(history, call_id=mistral_call_id)
    short = mistral_call_id(call.id)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", short) and short == mistral_call_id(call.id)
    assert [c["id"] for c in rendered[0]["tool_calls"]] == [short, mistral_call_id("c2")]
    assert [c["function"]["arguments"] for c in rendered[0]["tool_calls"]] == [{"a": [1]}, "not json"]
    assert rendered[1]["tool_call_id"] == short
    assert template_messages(history)[1]["tool_call_id"] == call.id
