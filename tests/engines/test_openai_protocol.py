"""The remote engine's sans-I/O core (convo.engines.openai.protocol / retry / config): the
HTTP status and httpx error mapping, SSE decoding over arbitrary chunk splits, retry
decisions, the endpoint's credential handling, and the deprecated flat keywords. No
server, no transport: pure functions and one Attempt fed by hand."""

from __future__ import annotations

import json
import random
import threading
import time
import warnings
from typing import Any

import httpx
import pytest

from convo.engines.base import GenerateRequest
from convo.engines.openai import ConnectionLimits, OpenAIEngine, RetryPolicy, Timeouts
from convo.engines.openai.protocol import (
    Attempt,
    Call,
    Endpoint,
    Reply,
    SSEDecoder,
    chat_body,
    finish_reason,
    parse_models,
    status_error,
)
from convo.engines.openai.retry import Retryable, decide_retry, is_retryable_status
from convo.errors import BudgetError, ConfigError, GenerationTimeout, RemoteEngineError
from convo.messages import Message, Role, ToolCall
from convo.models import FinishReason, Sampling

ENDPOINT = Endpoint.parse("http://engine.test/v1")


def err(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


# -- HTTP status -> outcome ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 507, 599])
def test_retryable_statuses_become_retryable_with_retry_after(status: int) -> None:
    out = status_error(ENDPOINT, status, err("busy"), "2")
    assert isinstance(out, Retryable) and out.status == status and out.retry_after_s == 2.0
    assert "busy" in str(out) and is_retryable_status(status)


@pytest.mark.parametrize(
    ("status", "body", "kind", "says"),
    [
        (401, err("nope"), RemoteEngineError, "API key"),
        (403, err("nope"), RemoteEngineError, "API key"),
        (404, b'{"detail": "Not Found"}', RemoteEngineError, "model name"),
        (422, b"plain text complaint", RemoteEngineError, "plain text complaint"),
        (501, err("no such thing"), RemoteEngineError, "HTTP 501"),
        (505, err("http version"), RemoteEngineError, "HTTP 505"),
        (400, err("bad temperature"), RemoteEngineError, "bad temperature"),
        (400, err("This model's maximum context length is 512 tokens"), BudgetError, "does not fit"),
    ],
)
def test_final_statuses_map_to_convo_errors(status: int, body: bytes, kind: type, says: str) -> None:
    out = status_error(ENDPOINT, status, body, None)
    assert type(out) is kind and says in str(out)
    if kind is RemoteEngineError:
        assert out.status == status  # type: ignore[attr-defined]
    assert not is_retryable_status(status)


def test_a_server_echoing_the_key_does_not_put_it_in_the_error() -> None:
    endpoint = Endpoint.parse("http://ada:pa55word@engine.test", api_key="sk-live-123")
    out = status_error(endpoint, 401, err("bad key sk-live-123 for ada:pa55word"), None)
    assert "sk-live-123" not in str(out) and "pa55word" not in str(out) and "***" in str(out)


# -- httpx errors -> outcome (one Attempt, fed by hand) -----------------------------------------


def make_call(*, timeout_s: float = 30.0, stream: bool = True, cancel: threading.Event | None = None) -> Call:
    on_text = (lambda s: None) if stream else None
    request = GenerateRequest(max_new_tokens=8, on_text=on_text, cancel=cancel)
    start = time.monotonic()
    return Call(request, 5, {}, RetryPolicy(), start, start + timeout_s)


def attempt_for(call: Call | None = None) -> Attempt:
    return Attempt(ENDPOINT, call or make_call(), connect_s=10.0)


def sse(*pieces: str, done: bool = True) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    raw = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (raw + ("data: [DONE]\n\n" if done else "")).encode()


def outcome(attempt: Attempt, exc: BaseException) -> BaseException | Reply:
    """What ``exc`` raised inside ``attempt.errors()`` ends in: an exception, or the reply."""
    try:
        with attempt.errors():
            raise exc
    except BaseException as out:
        return out
    return attempt.reply()


REQUEST = httpx.Request("POST", "http://engine.test/v1/chat/completions")


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused", request=REQUEST), Retryable),
        (httpx.ConnectTimeout("slow", request=REQUEST), Retryable),
        (httpx.RemoteProtocolError("closed", request=REQUEST), Retryable),
        (httpx.WriteTimeout("stuck", request=REQUEST), GenerationTimeout),
        (httpx.ReadTimeout("no headers", request=REQUEST), GenerationTimeout),
        (TimeoutError(), GenerationTimeout),  # the async deadline
    ],
)
def test_failures_before_an_answer(exc: BaseException, kind: type) -> None:
    assert type(outcome(attempt_for(), exc)) is kind


def test_a_connect_timeout_past_the_deadline_is_not_retried() -> None:
    attempt = attempt_for(make_call(timeout_s=0.01))
    time.sleep(0.02)
    out = outcome(attempt, httpx.ConnectTimeout("slow", request=REQUEST))
    assert isinstance(out, GenerationTimeout)


def test_failures_while_reading_depend_on_whether_text_came() -> None:
    silent = attempt_for()
    silent.responded()
    assert isinstance(outcome(silent, httpx.ReadError("reset", request=REQUEST)), Retryable)
    silent = attempt_for()
    silent.responded()
    assert isinstance(outcome(silent, httpx.ReadTimeout("slow", request=REQUEST)), GenerationTimeout)

    def talked() -> Attempt:
        attempt = attempt_for()
        attempt.responded()
        assert not attempt.feed(sse("Hel", "lo", done=False))
        return attempt

    out = outcome(talked(), httpx.ReadError("reset", request=REQUEST))
    assert isinstance(out, RemoteEngineError) and "mid-reply" in str(out)
    for cut in (httpx.ReadTimeout("slow", request=REQUEST), TimeoutError()):
        out = outcome(talked(), cut)  # the deadline cut a reply under way: its text stands
        assert isinstance(out, Reply) and out.text == "Hello" and out.finish is None


def test_a_cut_we_made_keeps_the_partial_reply() -> None:
    cancel = threading.Event()
    attempt = attempt_for(make_call(cancel=cancel))
    attempt.responded()
    attempt.feed(sse("a", done=False))
    cancel.set()
    assert attempt.feed(b": keep-alive\n\n")  # stop reading
    out = outcome(attempt, httpx.StreamClosed())
    assert isinstance(out, Reply) and out.text == "a"
    assert finish_reason(out, cancel=cancel, deadline=attempt.call.deadline, now=0) is FinishReason.CANCELLED

    watched = attempt_for()
    watched.responded()
    watched.deadline_hit = True  # the watchdog closed it before any text
    assert isinstance(outcome(watched, httpx.ReadError("closed", request=REQUEST)), GenerationTimeout)


def test_convo_errors_and_retryable_pass_through_and_decoding_errors_are_remote_errors() -> None:
    attempt = attempt_for()
    attempt.responded()
    budget = BudgetError("too big")
    assert outcome(attempt, budget) is budget
    retry = Retryable("again")
    assert outcome(attempt, retry) is retry
    out = outcome(attempt, httpx.DecodingError("bad gzip", request=REQUEST))
    assert isinstance(out, RemoteEngineError) and "decoded" in str(out)


def test_an_attempt_without_time_left_is_a_timeout_and_bad_bodies_are_remote_errors() -> None:
    with pytest.raises(GenerationTimeout):
        Attempt(ENDPOINT, make_call(timeout_s=-1), connect_s=1.0)
    attempt = attempt_for(make_call(stream=False))
    with pytest.raises(RemoteEngineError, match="not JSON"):
        attempt.read_plain(b"<html>oops</html>")
    with pytest.raises(RemoteEngineError, match="without choices"):
        attempt.read_plain(b'{"object": "chat.completion"}')
    attempt.read_plain(
        json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}]}).encode()
    )
    assert attempt.reply() == Reply("ok", "length", None)
    streamed = attempt_for()
    with pytest.raises(RemoteEngineError, match="stream error: overloaded"):
        streamed.feed(b'data: {"error": {"message": "overloaded"}}\n\n')


# -- SSE decoding --------------------------------------------------------------------------------

STREAM = (
    'data: {"choices": [{"delta": {"content": "caf\u00e9 \u2028 \U0001f600"}}]}\r\n\r\n'
    ": a comment\n"
    "event: message\n"
    'data: {"choices": [{"delta": \n'
    'data: {"content": "two lines"}}]}\n\n'
    "   \n"
    'data:{"usage": {"prompt_tokens": 3}}\r\r'
    "data: [DONE]\n\n"
    'data: {"after": "done"}\n\n'
).encode()
EXPECTED = [
    {"choices": [{"delta": {"content": "caf\u00e9 \u2028 \U0001f600"}}]},
    {"choices": [{"delta": {"content": "two lines"}}]},
    {"usage": {"prompt_tokens": 3}},
]


def decode(chunks: list[bytes]) -> tuple[list[dict[str, Any]], bool]:
    decoder = SSEDecoder()
    events = [e for chunk in chunks for e in decoder.feed(chunk)]
    return events + decoder.flush(), decoder.done


def test_sse_whole_stream() -> None:
    assert decode([STREAM]) == (EXPECTED, True)


def test_sse_split_at_every_byte_gives_the_same_events() -> None:
    """Every two-way split (inside a UTF-8 character, between \\r and \\n, inside
    ``data:``), and one byte at a time."""
    for cut in range(1, len(STREAM)):
        assert decode([STREAM[:cut], STREAM[cut:]]) == (EXPECTED, True), cut
    assert decode([STREAM[i : i + 1] for i in range(len(STREAM))]) == (EXPECTED, True)


def test_sse_random_splits_and_an_unterminated_last_event() -> None:
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(STREAM)), 6))
        chunks = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
        assert decode(chunks) == (EXPECTED, True)
    assert decode([b'data: {"a": 1}\n\ndata: {"b": 2}']) == ([{"a": 1}, {"b": 2}], False)
    assert decode([b'data: {"a": 1}\r']) == ([{"a": 1}], False)


def test_sse_events_arrive_as_soon_as_their_blank_line_does() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a": 1}\n') == []
    assert decoder.feed(b"\n") == [{"a": 1}]
    with pytest.raises(RemoteEngineError, match="bad event"):
        decoder.feed(b"data: {not json\n\n")
    with pytest.raises(RemoteEngineError, match="bad event"):
        SSEDecoder().feed(b"data: [1, 2]\n\n")


# -- retry decisions -----------------------------------------------------------------------------


def decide(failure: Retryable, *, attempts: int = 0, now: float = 0.0, deadline: float = 60.0, **policy: Any):
    return decide_retry(
        RetryPolicy(jitter=0, **policy),
        failure,
        attempts=attempts,
        now=now,
        start=0.0,
        deadline=deadline,
        where="http://h/v1",
    )


def test_retry_backoff_schedule_and_retry_after() -> None:
    waits = [decide(Retryable("x"), attempts=i, max_retries=5, max_backoff_s=3).wait_s for i in range(5)]
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert decide(Retryable("x", status=429, retry_after_s=4.0)).wait_s == 4.0
    rng = random.Random(1)
    jittery = [RetryPolicy(backoff_s=1, jitter=0.5).delay_s(0, rng=rng) for _ in range(100)]
    assert all(0.5 <= w <= 1.0 for w in jittery) and len(set(jittery)) > 50


def test_retry_gives_up_with_typed_errors() -> None:
    spent = decide(Retryable("HTTP 502: bad", status=502), attempts=3, max_retries=3)
    assert not spent.retry and isinstance(spent.error, RemoteEngineError)
    assert spent.error.status == 502 and "4 attempts" in str(spent.error)
    too_long = decide(Retryable("HTTP 429", status=429, retry_after_s=120.0))
    assert isinstance(too_long.error, RemoteEngineError) and too_long.error.retry_after_s == 120.0
    late = decide(Retryable("reset"), now=59.8, deadline=60.0)
    assert isinstance(late.error, GenerationTimeout)
    assert decide(Retryable("reset"), max_retries=0).error is not None


# -- requests, discovery, endpoint ---------------------------------------------------------------


def test_chat_body_sends_optional_sampling_only_when_set() -> None:
    msgs = [Message(role=Role.USER, content="hi")]
    plain = chat_body(
        model="m", messages=msgs, max_new_tokens=4, sampling=Sampling(), stop=(), stream=False, extra_body={}
    )
    assert set(plain) == {"model", "messages", "max_tokens", "temperature", "top_p", "stream"}
    full = chat_body(
        model="m",
        messages=msgs,
        max_new_tokens=4,
        sampling=Sampling(temperature=0.7, top_k=5, repetition_penalty=1.1, min_new_tokens=2, seed=3),
        stop=["\n"],
        stream=True,
        extra_body={"cache_prompt": True},
    )
    assert full["top_k"] == 5 and full["repetition_penalty"] == 1.1 and full["min_tokens"] == 2
    assert full["seed"] == 3 and full["stop"] == ["\n"] and full["cache_prompt"] is True
    assert full["stream_options"] == {"include_usage": True}


def test_parse_models_reads_name_and_window() -> None:
    listing = {"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "meta": {"n_ctx_train": 2048}}]}
    body = json.dumps(listing).encode()
    assert parse_models(ENDPOINT, 200, body, None) == parse_models(ENDPOINT, 200, body, "a")
    assert parse_models(ENDPOINT, 200, body, "b").context_window == 2048
    assert parse_models(ENDPOINT, 200, b'{"data": [{"id": "x"}]}', None).context_window is None
    with pytest.raises(RemoteEngineError, match="lists no model"):
        parse_models(ENDPOINT, 200, b'{"data": []}', None)
    with pytest.raises(RemoteEngineError) as info:
        parse_models(ENDPOINT, 503, b"down", None)
    assert info.value.status == 503


def test_endpoint_keeps_credentials_out_of_urls_and_messages() -> None:
    e = Endpoint.parse("https://ada:p%40ss@h.example:8443/api/", api_key="sk-1")
    assert e.url == "https://h.example:8443/api/v1" and e.auth == ("ada", "p@ss")
    assert e.shown == "https://ada:***@h.example:8443/api/v1"
    assert e.headers == {"Authorization": "Bearer sk-1"}
    assert e.scrub("p@ss p%40ss sk-1 ada") == "*** *** *** ada"
    assert "sk-1" not in repr(e) and "p@ss" not in repr(e)
    token = Endpoint.parse("http://tok123@h/v1")
    assert token.shown == "http://***@h/v1" and token.auth == ("tok123", "")
    assert Endpoint.parse("http://h:8000").url == "http://h:8000/v1"
    for bad in ("localhost:8000", "ftp://h/v1", "http://", "ada:secret@h:80"):
        with pytest.raises(ConfigError) as info:
            Endpoint.parse(bad)
        assert "secret" not in str(info.value)


# -- settings ------------------------------------------------------------------------------------


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError):
        Timeouts(call_s=0)
    with pytest.raises(ConfigError):
        Timeouts(connect_s=-1)
    with pytest.raises(ConfigError):
        ConnectionLimits(max_connections=0)
    with pytest.raises(ConfigError):
        RetryPolicy(max_retries=-1)
    with pytest.raises(TypeError):
        Timeouts(5)  # type: ignore[misc]  # keyword-only


def test_flat_keywords_still_work_for_one_release_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"timeouts=Timeouts\(call_s=...\)"):
        engine = OpenAIEngine(
            "http://h/v1",
            "m",
            context_window=512,
            timeout_s=5,
            connect_timeout_s=2,
            max_connections=3,
            max_retries=0,
            backoff_s=0.1,
        )
    assert engine.timeouts == Timeouts(call_s=5, connect_s=2) and engine.timeout_s == 5
    assert engine.limits == ConnectionLimits(max_connections=3) and engine.concurrent_calls == 3
    assert engine.retry == RetryPolicy(max_retries=0, backoff_s=0.1)
    policy = RetryPolicy(max_retries=7)
    with pytest.warns(DeprecationWarning):
        assert OpenAIEngine("http://h/v1", retry=policy, max_retries=1).retry is policy  # as in 0.1
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="both timeouts= and timeout_s="):
        OpenAIEngine("http://h/v1", timeouts=Timeouts(), timeout_s=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        OpenAIEngine("http://h/v1", timeout=5)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError):
        OpenAIEngine("http://h/v1", timeout_s=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped form does not warn
        OpenAIEngine("http://h/v1", timeouts=Timeouts(call_s=5), limits=ConnectionLimits(max_connections=2))


# -- tools: request bodies, replies, streamed pieces, the request's checks -------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_chat_body_sends_tools_only_when_set_and_the_prompt_in_openai_shape() -> None:
    call = ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    msgs = [
        Message(role=Role.USER, content="weather?"),
        Message(role=Role.ASSISTANT, content="", tool_calls=(call,)),
        Message(role=Role.TOOL, content='{"temp_c": 18}', tool_call_id="c1", name="get_weather"),
    ]
    base = {"model": "m", "max_new_tokens": 8, "sampling": Sampling(), "stop": (), "stream": False}
    plain = chat_body(messages=msgs, extra_body={}, **base)  # type: ignore[arg-type]
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(plain)
    assert plain["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert plain["messages"][2] == {
        "role": "tool",
        "content": '{"temp_c": 18}',
        "tool_call_id": "c1",
        "name": "get_weather",
    }
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = chat_body(
        messages=msgs,
        extra_body={},
        tools=(WEATHER,),
        tool_choice=choice,
        parallel_tool_calls=False,
        **base,  # type: ignore[arg-type]
    )
    assert (
        body["tools"] == [WEATHER] and body["tool_choice"] == choice and body["parallel_tool_calls"] is False
    )
    json.dumps(body)  # a JSON body, tuples and mappings included


def reply_body(message: dict[str, Any], finish: str = "tool_calls") -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": message, "finish_reason": finish}]}).encode()


def test_plain_replies_carry_their_tool_calls() -> None:
    from convo.engines.openai.protocol import parse_plain

    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
        {"type": "function", "function": {"name": "ping"}},  # no id, no arguments
    ]
    reply = parse_plain(ENDPOINT, reply_body({"role": "assistant", "content": None, "tool_calls": calls}))
    assert reply.text == "" and reply.finish == "tool_calls"
    a, b, c = reply.tool_calls
    assert (a.id, a.name, a.parsed_arguments) == ("a", "get_weather", {"city": "Oslo"})
    assert b.arguments == '{"tz": "CET"}'  # an object is serialized
    assert c.id.startswith("call_") and len(c.id) == 29 and c.arguments == "{}"  # a fresh id
    legacy = parse_plain(ENDPOINT, reply_body({"function_call": {"name": "f", "arguments": "{}"}}))
    assert [(t.name, t.arguments) for t in legacy.tool_calls] == [("f", "{}")]
    assert parse_plain(ENDPOINT, reply_body({"content": "hi"}, "stop")).tool_calls == ()
    for bad in ([{"id": "x", "function": {"arguments": "{}"}}], [{"id": "x"}], "nope"):
        with pytest.raises(RemoteEngineError, match=r"tool.call"):
            parse_plain(ENDPOINT, reply_body({"tool_calls": bad}))


def test_arguments_that_are_not_json_are_kept_as_sent_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from convo.engines.openai.protocol import parse_plain

    broken = '{"city": "Par'
    call = {"id": "c9", "function": {"name": "get_weather", "arguments": broken}}
    with caplog.at_level("WARNING", logger="convo.engines.openai"):
        reply = parse_plain(ENDPOINT, reply_body({"tool_calls": [call]}))
    (got,) = reply.tool_calls
    assert got.arguments == broken and got.parsed_arguments is None
    assert "c9" in caplog.text and "get_weather" in caplog.text and broken not in caplog.text
    assert ToolCall(id="x", name="f", arguments="[1]").parsed_arguments is None  # JSON, not an object


@pytest.mark.parametrize(
    ("finish", "has_calls", "expected"),
    [
        ("tool_calls", True, FinishReason.TOOL_CALLS),
        ("stop", True, FinishReason.TOOL_CALLS),  # vLLM / SGLang parsers may say "stop"
        ("function_call", True, FinishReason.TOOL_CALLS),
        ("tool_calls", False, FinishReason.STOP),  # said so, sent none
        ("length", True, FinishReason.LENGTH),  # cut inside the arguments
        ("stop", False, FinishReason.STOP),
    ],
)
def test_finish_reason_of_tool_calls(finish: str, has_calls: bool, expected: FinishReason) -> None:
    calls = (ToolCall(id="c", name="f"),) if has_calls else ()
    reply = Reply("", finish, tool_calls=calls)
    assert finish_reason(reply, cancel=None, deadline=time.monotonic() + 9, now=time.monotonic()) is expected


def tool_events(style: str) -> list[dict[str, Any]]:
    """Two parallel calls streamed the OpenAI way (id and name once, then fragments) or the
    llama-cpp-python way (id and whole name repeated on every piece), with content around."""
    pieces = [
        (0, "c0", "get_weather", '{"city": '),
        (1, "c1", "get_time", ""),
        (0, "c0", "get_weather", '"Oslo"}'),
    ]
    pieces.append((1, "c1", "get_time", '{"tz": "CET"}'))
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Sure. "}}]}
    ]
    seen: set[int] = set()
    for index, call_id, name, args in pieces:
        first = index not in seen
        seen.add(index)
        tc: dict[str, Any] = {"index": index, "function": {"arguments": args}}
        if first or style == "llama":
            tc.update(id=call_id, type="function")
            tc["function"]["name"] = name
        events.append({"choices": [{"index": 0, "delta": {"content": None, "tool_calls": [tc]}}]})
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 12}})
    return events


def sse_events(events: list[dict[str, Any]]) -> bytes:
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()


@pytest.mark.parametrize("style", ["openai", "llama"])
def test_streamed_tool_calls_are_put_together_and_only_text_reaches_on_text(style: str) -> None:
    from convo.models.generation import ToolCallDelta

    raw = sse_events(tool_events(style))
    texts: list[str] = []
    deltas: list[ToolCallDelta] = []
    request = GenerateRequest(
        max_new_tokens=32, tools=[WEATHER], on_text=texts.append, on_tool_call_delta=deltas.append
    )
    call = Call(request, 5, {}, RetryPolicy(), time.monotonic(), time.monotonic() + 30)
    attempt = Attempt(ENDPOINT, call, connect_s=5)
    for i in range(len(raw)):  # split at every byte
        attempt.feed(raw[i : i + 1])
    reply = attempt.reply()
    assert texts == ["Sure. "] and reply.text == "Sure. "
    assert [(c.id, c.name, c.parsed_arguments) for c in reply.tool_calls] == [
        ("c0", "get_weather", {"city": "Oslo"}),
        ("c1", "get_time", {"tz": "CET"}),
    ]
    # The pieces passed on are OpenAI's: id and name once per call, then fragments only.
    assert [(d.index, d.id, d.name) for d in deltas] == [
        (0, "c0", "get_weather"),
        (1, "c1", "get_time"),
        (0, None, None),
        (1, None, None),
    ]
    joined = {i: "".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)}
    assert joined == {0: '{"city": "Oslo"}', 1: '{"tz": "CET"}'}
    assert reply.tool_chunks == 4 and reply.first_text_at is not None
    assert (
        finish_reason(reply, cancel=None, deadline=call.deadline, now=time.monotonic())
        is FinishReason.TOOL_CALLS
    )


def test_tool_call_streams_cut_or_malformed() -> None:
    from convo.engines.openai.tool_calls import ToolCallStream

    cut = ToolCallStream("srv")
    cut.feed([{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x": '}}])
    cut.feed([{"index": 1, "id": "b"}])  # the name never came: the stream was cut
    (only,) = cut.calls(cut=True)
    assert only.arguments == '{"x": ' and only.parsed_arguments is None
    with pytest.raises(RemoteEngineError, match="without a function name"):
        cut.calls()
    no_index = ToolCallStream("srv")
    no_index.feed([{"id": "a", "function": {"name": "f"}}, {"id": "b", "function": {"name": "g"}}])
    assert [c.name for c in no_index.calls()] == ["f", "g"]  # position stands for the index
    for bad in ("x", [1], [{"index": -1}], [{"index": "0"}]):
        with pytest.raises(RemoteEngineError):
            ToolCallStream("srv").feed(bad)


def test_a_deadline_after_a_tool_call_piece_keeps_the_partial_reply() -> None:
    request = GenerateRequest(max_new_tokens=8, tools=[WEATHER], on_tool_call_delta=lambda d: None)
    call = Call(request, 5, {}, RetryPolicy(), time.monotonic(), time.monotonic() + 30)
    attempt = Attempt(ENDPOINT, call, connect_s=5)
    attempt.responded()
    no_text = tool_events("openai")[1:3]  # two tool-call pieces, no content
    attempt.feed(b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in no_text))
    attempt.deadline_hit = True
    with attempt.errors():
        raise httpx.ReadError("closed by the watchdog")
    reply = attempt.reply()  # no GenerationTimeout: a tool-call piece was passed on
    assert reply.finish is None and reply.tool_chunks == 2 and reply.chunks == 0
    assert [c.name for c in reply.tool_calls] == ["get_weather", "get_time"]


def test_generate_request_checks_tools_and_tool_choice() -> None:
    request = GenerateRequest(max_new_tokens=4, tools=[WEATHER], tool_choice="required")
    assert request.tools == (WEATHER,) and request.wants_tools and not request.streams
    assert GenerateRequest(max_new_tokens=4, tools=[]).tools is None
    assert not GenerateRequest(max_new_tokens=4, tool_choice="none").wants_tools
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert GenerateRequest(max_new_tokens=4, tools=[WEATHER], tool_choice=named).tool_choice == named
    assert GenerateRequest(max_new_tokens=4, on_tool_call_delta=lambda d: None).streams
    for bad in (
        {"tools": [{"type": "retrieval"}]},
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"tools": ["get_weather"]},
        {"tool_choice": "auto"},  # no tools
        {"tools": [WEATHER], "tool_choice": "always"},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
        {"tools": [WEATHER], "tool_choice": {"type": "function"}},
    ):
        with pytest.raises(ConfigError):
            GenerateRequest(max_new_tokens=4, **bad)


def test_engines_without_tool_support_refuse_tools() -> None:
    from convo.errors import ToolsNotSupported

    request = GenerateRequest(max_new_tokens=4, tools=[WEATHER])
    # check_prompt's default is an engine that predates tools: it refuses them...
    with pytest.raises(ToolsNotSupported, match="does not support tools"):
        request.check_prompt(10, input_cap=100, cap_name="the cap")
    with pytest.raises(ConfigError):  # (a ConfigError, for handlers that predate it)
        request.check_tools(supports_tools=False, engine="LocalThing")
    # ...an engine that declares support accepts them, and calls without tools pass anywhere.
    request.check_prompt(10, input_cap=100, cap_name="the cap", supports_tools=True)
    GenerateRequest(max_new_tokens=4).check_prompt(10, input_cap=100, cap_name="the cap")
    assert OpenAIEngine.supports_tools is True
