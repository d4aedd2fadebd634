"""The remote engine: pure client logic on httpx.MockTransport, then real servers on loopback
(``convo serve`` with its test engine, and llama-cpp-python's server on the default GGUF)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from convo import Session
from convo.engines.openai import OpenAIEngine, RetryPolicy, Timeouts, parse_retry_after
from convo.errors import BudgetError, ConfigError, GenerationTimeout, RemoteEngineError
from convo.messages import Message, Role
from convo.models import FinishReason
from convo.summarize import SummaryStatus, SummaryWorker
from convo.testing import wait_until_serving

USER = [Message(role=Role.USER, content="hello there")]


def ok_body(text: str = "hi!", finish: str = "stop", prompt: int = 11, completion: int = 2) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def mock_engine(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> OpenAIEngine:
    kwargs.setdefault("retry", RetryPolicy(max_retries=3, backoff_s=0.01, jitter=0))
    return OpenAIEngine(
        "http://engine.test/v1", "m", context_window=4096, transport=httpx.MockTransport(handler), **kwargs
    )


# -- pure client logic (MockTransport) ----------------------------------------------------------


def test_plain_reply_maps_finish_reason_and_usage() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=ok_body("a b c", finish="length", prompt=40, completion=3))

    engine = mock_engine(handler)
    gen = engine.generate(USER, max_new_tokens=3, stop=["\n\n"])
    assert gen.text == "a b c" and gen.finish_reason is FinishReason.LENGTH
    s = gen.stats
    assert (s.prompt_tokens, s.new_tokens, s.memory_kind, s.kv_bytes, s.peak_allocated_bytes) == (
        40,
        3,
        "remote",
        0,
        0,
    )
    body = seen[0]
    assert body["max_tokens"] == 3 and body["temperature"] == 0.0 and body["stop"] == ["\n\n"]
    assert body["stream"] is False and body["messages"] == [{"role": "user", "content": "hello there"}]
    assert engine.observed_token_ratio == 40 / engine.counter.count_prompt(USER)


def test_retries_429_and_5xx_honoring_retry_after() -> None:
    statuses = iter([429, 503, 200])
    times: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        status = next(statuses)
        if status == 429:
            return httpx.Response(429, headers={"Retry-After": "0.3"}, json={"error": {"message": "busy"}})
        if status == 503:
            return httpx.Response(503, text="overloaded")
        return httpx.Response(200, json=ok_body())

    engine = mock_engine(handler)
    assert engine.generate(USER, max_new_tokens=8).text == "hi!"
    assert engine.retries == 2
    assert times[1] - times[0] >= 0.3  # Retry-After honored (the backoff alone is 0.01 s)
    assert times[2] - times[1] < 0.3  # then the backoff: 0.02 s


def test_gives_up_with_typed_error_and_does_not_retry_client_errors() -> None:
    calls = {"n": 0}

    def always(status: int, message: str) -> Callable[[httpx.Request], httpx.Response]:
        def handler(request: httpx.Request) -> httpx.Response:
            calls["n"] += 1
            return httpx.Response(status, json={"error": {"message": message}})

        return handler

    with pytest.raises(RemoteEngineError) as info:
        mock_engine(always(502, "bad gateway")).generate(USER, max_new_tokens=4)
    assert info.value.status == 502 and calls["n"] == 4  # 1 + max_retries
    calls["n"] = 0
    with pytest.raises(RemoteEngineError, match="API key") as info:
        mock_engine(always(401, "nope")).generate(USER, max_new_tokens=4)
    assert info.value.status == 401 and calls["n"] == 1
    calls["n"] = 0
    msg = "This model's maximum context length is 512 tokens. However, you requested 900 tokens"
    with pytest.raises(BudgetError, match="does not fit"):
        mock_engine(always(400, msg)).generate(USER, max_new_tokens=4)
    assert calls["n"] == 1
    # A Retry-After longer than the policy accepts ends the retries at once.
    calls["n"] = 0

    def long_wait(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(429, headers={"Retry-After": "120"})

    with pytest.raises(RemoteEngineError) as info:
        mock_engine(long_wait).generate(USER, max_new_tokens=4)
    assert info.value.retry_after_s == 120 and calls["n"] == 1


def test_connection_errors_are_retried() -> None:
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=ok_body())

    assert mock_engine(handler).generate(USER, max_new_tokens=4).text == "hi!"
    assert calls["n"] == 3
    engine = OpenAIEngine(
        f"http://127.0.0.1:{free_port()}",
        "m",
        context_window=512,
        retry=RetryPolicy(max_retries=1, backoff_s=0),
    )
    with pytest.raises(RemoteEngineError, match="2 attempts") as info:
        engine.generate(USER, max_new_tokens=4)
    assert info.value.status is None


def test_sse_stream_is_parsed_with_usage() -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}},
    ]
    raw = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ": keep-alive\n\ndata: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        return httpx.Response(200, content=raw.encode(), headers={"content-type": "text/event-stream"})

    pieces: list[str] = []
    gen = mock_engine(handler).generate(USER, max_new_tokens=8, on_text=pieces.append)
    assert pieces == ["Hel", "lo"] and gen.text == "Hello" and gen.finish_reason is FinishReason.STOP
    assert gen.stats.prompt_tokens == 9 and gen.stats.new_tokens == 2


def test_budget_is_checked_before_the_request_and_margin_is_documented() -> None:
    def handler(request: httpx.Request) -> httpx.Response:  # pragma: no cover - never reached
        raise AssertionError("the request must not leave")

    engine = mock_engine(handler)
    assert not engine.exact_counter
    assert engine.margin_tokens == engine.recommended_margin_tokens(4096) > 0
    assert engine.context_window == 4096 - engine.margin_tokens
    budget = engine.budget(context_tokens=1024, max_new_tokens=128)
    assert budget.margin_tokens == engine.recommended_margin_tokens(1024) == 256 + 32
    # A budget over the server's whole window gives prompts that generate() accepts, however
    # full (the margin of both is the window's).
    for max_new in (16, 128, 512):
        full = engine.budget(max_new_tokens=max_new)
        assert full.available_prompt_tokens + max_new <= engine.context_window
    big = [Message(role=Role.USER, content="word " * 5000)]
    with pytest.raises(BudgetError):
        engine.generate(big, max_new_tokens=16)
    with pytest.raises(BudgetError):
        engine.generate(USER, max_new_tokens=16, max_prompt_tokens=2)
    with pytest.raises(ConfigError):
        OpenAIEngine("localhost:8000")


def test_generate_takes_the_engine_keywords_and_no_others() -> None:
    """The keyword signature every engine shares (GenerateOptions): an unknown keyword is a
    TypeError, a reply cap below 1 a ConfigError, sync and async alike; nothing is sent."""
    sent: list[httpx.Request] = []
    engine = mock_engine(lambda r: sent.append(r) or httpx.Response(200, json=ok_body("x")))
    with pytest.raises(TypeError):
        engine.generate(USER, max_new_tokens=8, temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(ConfigError):
        engine.generate(USER, max_new_tokens=0)
    with pytest.raises(TypeError):
        asyncio.run(engine.agenerate(USER, max_new_tokens=8, cache=None))  # type: ignore[call-arg]
    assert not sent
    out = engine.generate(USER, max_new_tokens=8, stop=["\n"], cache_key="s", timeout_s=5)
    assert out.text == "x" and json.loads(sent[0].content)["stop"] == ["\n"]


def test_retry_policy_and_retry_after_parsing() -> None:
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3, jitter=0)
    assert [policy.delay_s(i) for i in range(4)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.delay_s(0, retry_after_s=5) == 5
    jittery = RetryPolicy(backoff_s=1, jitter=0.5)
    assert all(0.5 <= jittery.delay_s(0) <= 1.0 for _ in range(50))
    assert parse_retry_after("7") == 7 and parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    with pytest.raises(ConfigError):
        RetryPolicy(jitter=2)


def test_async_calls_retry_and_stream_like_sync_ones() -> None:
    """agenerate runs the same core: retries with Retry-After, SSE split anywhere, typed errors."""
    statuses = iter([503, 200, 401])
    events = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in ("a", "é")]
    raw = (
        "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]\n\n"
    ).encode()

    def handler(request: httpx.Request) -> httpx.Response:
        status = next(statuses)
        if status != 200:
            return httpx.Response(status, headers={"Retry-After": "0.05"}, json={"error": {"message": "x"}})
        # One byte at a time: a UTF-8 character and every line split across chunks.
        chunks = [raw[i : i + 1] for i in range(len(raw))]
        return httpx.Response(200, stream=_Chunks(chunks), headers={"content-type": "text/event-stream"})

    engine = mock_engine(handler)
    pieces: list[str] = []
    gen = asyncio.run(engine.agenerate(USER, max_new_tokens=8, on_text=pieces.append))
    assert pieces == ["a", "é"] and gen.text == "aé" and engine.retries == 1
    with pytest.raises(RemoteEngineError, match="API key") as info:
        asyncio.run(engine.agenerate(USER, max_new_tokens=8))
    assert info.value.status == 401


class _Chunks(httpx.AsyncByteStream, httpx.SyncByteStream):
    """A response body delivered in the given chunks (sync and async)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks

    async def __aiter__(self) -> Any:
        for chunk in self.chunks:
            yield chunk


# -- a scripted server on loopback (stdlib http.server) -----------------------------------------


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


Answer = Callable[[str, str, dict[str, str], Any], tuple[int, Any]]


@contextmanager
def loopback(answer: Answer) -> Iterator[tuple[str, list[dict[str, Any]], list[int]]]:
    """A keep-alive HTTP/1.1 server on 127.0.0.1 whose replies ``answer(method, path,
    headers, json_body)`` gives as ``(status, json-able body)`` (or ``bytes``: an event
    stream); yields its host:port, the
    requests it saw (client port, path, headers) and the client ports whose connection
    the client closed."""
    seen: list[dict[str, Any]] = []
    closed: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            headers = {k.lower(): v for k, v in self.headers.items()}
            seen.append({"port": self.client_address[1], "path": self.path, "headers": headers})
            status, payload = answer(self.command, self.path, headers, body)
            # bytes are an event stream, sent as they are; anything else is a JSON body
            stream = isinstance(payload, bytes)
            data = payload if stream else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "text/event-stream" if stream else "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def finish(self) -> None:
            super().finish()
            closed.append(self.client_address[1])

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen, closed
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_one_client_per_engine_keeps_its_connection_sync_and_async() -> None:
    """Calls reuse the engine's client (one keep-alive connection), sync and on an event
    loop; a new event loop gets its own client, closed when that loop ends."""
    with loopback(lambda *a: (200, ok_body())) as (host, seen, closed):
        with OpenAIEngine(f"http://{host}/v1", "m", context_window=4096) as engine:
            for _ in range(3):
                assert engine.generate(USER, max_new_tokens=4).text == "hi!"
            sync_ports = {r["port"] for r in seen}
            seen.clear()

            async def three() -> None:
                for _ in range(3):
                    assert (await engine.agenerate(USER, max_new_tokens=4)).text == "hi!"

            asyncio.run(three())
            first_loop = {r["port"] for r in seen}
            seen.clear()
            asyncio.run(three())
            second_loop = {r["port"] for r in seen}

            async def then_close() -> None:
                async with engine:  # aclose() closes the loop's client and its connection
                    await engine.agenerate(USER, max_new_tokens=4)
                    port = seen[-1]["port"]
                    assert port not in closed

                assert wait_for(lambda: port in closed)

            asyncio.run(then_close())
    assert len(sync_ports) == len(first_loop) == len(second_loop) == 1
    assert first_loop != second_loop  # each loop has its own connection
    assert wait_for(lambda: sync_ports | first_loop | second_loop <= set(closed))  # all closed


PASSWORD, API_KEY = "pa55-Wd_zq", "sk-test-KEY-9931"


BASIC_TOKEN = base64.b64encode(f"ada:{PASSWORD}".encode()).decode()


def secret_free(text: str) -> bool:
    return PASSWORD not in text and API_KEY not in text and BASIC_TOKEN not in text


def full_text(exc: BaseException) -> str:
    """An exception as a log line with its traceback would show it (chained causes too)."""
    return "".join(traceback.format_exception(exc))


def test_credentials_never_appear_in_errors_logs_or_reprs(caplog: pytest.LogCaptureFixture) -> None:
    """Defect 13: an engine URL's credentials appeared in the server log when a summary
    failed. The URL's user:password is sent as basic auth, and no error, log line (convo's
    or httpx's) or repr shows it or the API key."""
    caplog.set_level(logging.DEBUG)

    def answer(method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        if path.endswith("/models"):
            return 500, {"error": {"message": f"no listing for {headers.get('authorization')}"}}
        last = body["messages"][-1]["content"]
        if "Summarize" in last or last == "fail":  # echoes the credentials it got
            return 503, {"error": {"message": f"crashed for {headers.get('authorization')} {API_KEY}"}}
        if last == "refuse":
            return 401, {"error": {"message": f"bad key {API_KEY}"}}
        return 200, ok_body("fine")

    retry = RetryPolicy(max_retries=1, backoff_s=0, jitter=0)
    with loopback(answer) as (host, seen, _):
        url = f"http://ada:{PASSWORD}@{host}"
        engine = OpenAIEngine(url, "m", api_key=API_KEY, context_window=4096, retry=retry)
        assert secret_free(repr(engine)) and secret_free(engine.base_url) and "ada:***@" in engine.base_url
        assert engine.generate(USER, max_new_tokens=4).text == "fine"
        sent = seen[-1]["headers"]["authorization"]
        assert sent == f"Basic {BASIC_TOKEN}"  # still sent, as basic auth

        errors: list[BaseException] = []
        for content in ("fail", "refuse"):
            with pytest.raises(RemoteEngineError) as info:
                engine.generate([Message(role=Role.USER, content=content)], max_new_tokens=4)
            errors.append(info.value)
        with pytest.raises(RemoteEngineError) as info:
            asyncio.run(engine.agenerate([Message(role=Role.USER, content="fail")], max_new_tokens=4))
        errors.append(info.value)
        with pytest.raises(RemoteEngineError) as info:
            _ = OpenAIEngine(url, api_key=API_KEY, context_window=4096).model  # /v1/models fails
        errors.append(info.value)

        # The reported path: a background summary on the remote engine fails, the worker logs it.
        worker = SummaryWorker(threads=1, max_defer_s=0.0)
        try:
            budget = engine.budget(
                max_new_tokens=16, window_turns=1, summarize_batch_turns=1, summary_tokens=40
            )
            session = Session(engine, budget=budget, summaries=worker)
            session.send("first turn")
            session.send("second turn")
            state = session.wait_summary(timeout_s=30)
        finally:
            worker.close(wait=False)
        assert state.status is SummaryStatus.FAILED and "ada:***@" in state.error
        assert secret_free(state.error)
    unreachable_engine = OpenAIEngine(
        f"http://ada:{PASSWORD}@127.0.0.1:{free_port()}",
        "m",
        api_key=API_KEY,
        context_window=512,
        retry=retry,
    )
    with pytest.raises(RemoteEngineError) as info:
        unreachable_engine.generate(USER, max_new_tokens=4)
    errors.append(info.value)

    for exc in errors:
        assert secret_free(full_text(exc)), full_text(exc)
    assert "failed after 2 attempts" in str(errors[0]) and errors[1].status == 401  # type: ignore[attr-defined]
    logged = caplog.text + "".join(
        full_text(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1]
    )
    assert "retry 1 of 1" in logged and "summary of session" in logged and "HTTP Request" in logged
    assert secret_free(logged)


# -- tools through the engine: a fake OpenAI server on loopback ----------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [Message(role=Role.USER, content="What is the weather in Paris?")]


def tool_reply(arguments: str = '{"city": "Paris"}') -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    body = ok_body("", finish="tool_calls")
    body["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    return body


def tool_stream() -> bytes:
    """A reply that says a few words, then streams one call the OpenAI way."""
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": "Let me check. "},
        {
            "tool_calls": [
                {"index": 0, "id": "call_7", "type": "function", "function": {"name": "get_weather"}}
            ]
        },
        *(
            {"tool_calls": [{"index": 0, "function": {"arguments": a}}]}
            for a in ('{"ci', 'ty": "Pa', 'ris"}')
        ),
    ]
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59}})
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()


def test_tool_calls_round_trip_through_a_fake_openai_server() -> None:
    """tools / tool_choice / parallel_tool_calls go out; the reply's calls come back with
    finish reason tool_calls; the call and its result go back to the server in OpenAI's shape."""
    bodies: list[dict[str, Any]] = []

    def answer(method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        bodies.append(body)
        return 200, tool_reply() if len(bodies) == 1 else ok_body("18 degrees and sunny.")

    with (
        loopback(answer) as (host, _, _),
        OpenAIEngine(f"http://{host}/v1", "m", context_window=4096) as engine,
    ):
        gen = engine.generate(
            ASK, max_new_tokens=32, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False
        )
        assert gen.finish_reason is FinishReason.TOOL_CALLS and gen.text == ""
        (call,) = gen.tool_calls
        assert (call.id, call.name, call.parsed_arguments) == ("call_1", "get_weather", {"city": "Paris"})
        sent = bodies[0]
        assert sent["tools"] == [WEATHER] and sent["tool_choice"] == "auto"
        assert sent["parallel_tool_calls"] is False and sent["stream"] is False
        history = [
            *ASK,
            Message(role=Role.ASSISTANT, content="", tool_calls=gen.tool_calls),
            Message(role=Role.TOOL, content='{"temp_c": 18}', tool_call_id=call.id, name=call.name),
        ]
        final = engine.generate(history, max_new_tokens=32, tools=[WEATHER])
    assert final.text == "18 degrees and sunny." and final.finish_reason is FinishReason.STOP
    assert final.tool_calls == ()
    assert bodies[1]["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call.to_dict()]},
        {"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": "call_1", "name": "get_weather"},
    ]
    assert "tool_choice" not in bodies[1]  # only what the call set is sent


def test_broken_arguments_from_the_server_are_passed_on_as_sent() -> None:
    broken = '{"city": "Paris"'  # the model stopped before the brace
    with loopback(lambda *a: (200, tool_reply(broken))) as (host, _, _):
        with OpenAIEngine(f"http://{host}/v1", "m", context_window=4096) as engine:
            gen = engine.generate(ASK, max_new_tokens=32, tools=[WEATHER])
    (call,) = gen.tool_calls
    assert call.arguments == broken and call.parsed_arguments is None
    assert gen.finish_reason is FinishReason.TOOL_CALLS


def test_streamed_tool_calls_sync_and_async_over_loopback() -> None:
    """A stream hands content to on_text and the call's pieces to on_tool_call_delta; the
    Generation holds the joined call. The same on the event loop."""
    with loopback(lambda *a: (200, tool_stream())) as (host, _, _):
        with OpenAIEngine(f"http://{host}/v1", "m", context_window=4096) as engine:
            texts: list[str] = []
            deltas: list[Any] = []
            gen = engine.generate(
                ASK,
                max_new_tokens=32,
                tools=[WEATHER],
                on_text=texts.append,
                on_tool_call_delta=deltas.append,
            )

            async def streamed() -> Any:
                return await engine.agenerate(
                    ASK, max_new_tokens=32, tools=[WEATHER], on_tool_call_delta=deltas.append
                )

            agen = asyncio.run(streamed())
    assert texts == ["Let me check. "] and gen.text == "Let me check. "
    for g in (gen, agen):
        assert g.finish_reason is FinishReason.TOOL_CALLS
        assert [(c.id, c.name, c.arguments) for c in g.tool_calls] == [
            ("call_7", "get_weather", '{"city": "Paris"}')
        ]
        assert g.stats.prompt_tokens == 50 and g.stats.new_tokens == 9
    assert len(deltas) == 8  # 4 pieces per call, twice
    assert (deltas[0].id, deltas[0].name) == ("call_7", "get_weather")
    assert "".join(d.arguments for d in deltas[:4]) == '{"city": "Paris"}'


def test_the_prompt_check_counts_the_tool_schemas() -> None:
    def handler(request: httpx.Request) -> httpx.Response:  # pragma: no cover - never reached
        raise AssertionError("the request must not leave")

    engine = mock_engine(handler)
    bare = engine.counter.count_prompt(ASK)
    with_tools = engine.counter.count_with_tools(ASK, [WEATHER])
    assert with_tools == bare + engine.counter.count_tools([WEATHER]) > bare
    with pytest.raises(BudgetError, match=f"prompt of {with_tools} tokens"):
        engine.generate(ASK, max_new_tokens=8, tools=[WEATHER], max_prompt_tokens=with_tools - 1)
    with pytest.raises(ConfigError, match="needs tools"):
        engine.generate(ASK, max_new_tokens=8, tool_choice="required")


# -- a real OpenAI-compatible server: `convo serve` with its test engine -------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def process(cmd: list[str], ready_url: str, env: dict[str, str], timeout_s: float = 60) -> Iterator[None]:
    """Run a server process until ``ready_url`` answers 200; stop it afterwards. Its output
    goes to a temporary file (a pipe could fill up and stall a chatty server)."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not wait_until_serving(ready_url, proc, timeout_s):
                proc.kill()
                proc.wait()
                log.seek(0)
                raise AssertionError(f"{cmd[:4]} did not start: {log.read().decode()[-2000:]}")
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``convo serve`` with the test engine: 0.05 s per word, context 2048."""
    port = free_port()
    db = tmp_path_factory.mktemp("echo") / "s.db"
    cmd = [sys.executable, "-m", "convo.cli", "serve", "--port", str(port), "--db", str(db)]
    base = f"http://127.0.0.1:{port}"
    with process(cmd, f"{base}/health", {"CONVO_FAKE_ENGINE": "1", "CONVO_FAKE_DELAY_S": "0.05"}):
        yield base


def test_session_over_convo_serve_answers_streams_and_times_out(echo_url: str) -> None:
    engine = OpenAIEngine(echo_url, context_window=2048)  # model name from /v1/models
    assert engine.model == "echo"
    session = Session(engine, budget=engine.budget(max_new_tokens=64, summary_tokens=0))
    assert session.send("my name is Ada").text == "heard 1: my name is Ada"
    reply = session.send("who am I")
    assert reply.text == "heard 3: who am I"  # the history travelled to the remote model
    assert reply.stats.generation is not None and reply.stats.generation.memory_kind == "remote"
    pieces = list(session.stream("stream this"))
    assert "".join(pieces) == "heard 5: stream this" and len(pieces) == 4

    long = [Message(role=Role.USER, content=" ".join(f"w{i}" for i in range(60)))]  # about 3 s
    with pytest.raises(GenerationTimeout):
        engine.generate(long, max_new_tokens=100, timeout_s=0.4)
    t0 = time.monotonic()
    gen = engine.generate(long, max_new_tokens=100, timeout_s=0.4, on_text=lambda s: None)
    assert gen.finish_reason is FinishReason.TIMEOUT and gen.text.startswith("heard 1:")
    assert time.monotonic() - t0 < 1.0
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    gen = engine.generate(long, max_new_tokens=100, on_text=lambda s: None, cancel=cancel)
    assert gen.finish_reason is FinishReason.CANCELLED and 0 < len(gen.text.split()) < 20


def test_convo_serve_engine_url_chains_to_a_remote_engine(echo_url: str, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "convo.cli", "serve", "--port", str(port), "--db", str(tmp_path / "f.db")]
    cmd += ["--engine-url", f"{echo_url}/v1", "--engine-context", "2048", "--max-new-tokens", "64"]
    front = f"http://127.0.0.1:{port}"
    with process(cmd, f"{front}/health", {"CONVO_FAKE_ENGINE": "0"}):
        with openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0) as c:
            first = c.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Session-Id": "chain"},
            )
            second = c.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "again"}],
                extra_headers={"X-Session-Id": "chain"},
            )
        # The front keeps the session; the upstream sees the whole planned prompt each time.
        assert first.choices[0].message.content == "heard 1: hi"
        assert second.choices[0].message.content == "heard 3: again"
        msgs = httpx.get(f"{front}/v1/sessions/chain").json()["messages"]
        assert [m["content"] for m in msgs] == ["hi", "heard 1: hi", "again", "heard 3: again"]


# -- the real default model behind llama-cpp-python's server -------------------------------------

LLAMA_CTX = 512


def require_llama_cpp() -> None:
    """Skip without llama-cpp-python's server (fail with ``CONVO_REQUIRE_LLAMA_CPP=1``)."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CONVO_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"CONVO_REQUIRE_LLAMA_CPP=1 but llama-cpp-python[server] is missing: {exc}")
        pytest.skip("llama-cpp-python[server] is not installed (.ci/llama_cpp_wheel.sh)")


@pytest.fixture(scope="session")
def llama_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's OpenAI server on the default GGUF, n_ctx=512, on a free port.

    One thread: ggml's threads spin at a barrier on every op, so when another process
    wants the CPU (a shared 2-core CI machine) two threads run several times slower than
    one; on an idle machine one thread costs about 2x, a few seconds per test."""
    require_llama_cpp()
    from convo.engines.local.loading import default_gguf_path

    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf_path())]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(LLAMA_CTX)]
    cmd += ["--n_threads", "1", "--n_threads_batch", "1"]
    base = f"http://127.0.0.1:{port}"
    with process(cmd, f"{base}/v1/models", {}, timeout_s=120):
        yield base


@pytest.mark.slow
def test_llama_cpp_session_keeps_the_budget_and_summarizes(llama_url: str) -> None:
    engine = OpenAIEngine(llama_url, context_window=LLAMA_CTX, timeouts=Timeouts(call_s=120))
    budget = engine.budget(max_new_tokens=32, window_turns=2, summary_tokens=48, summarize_batch_turns=1)
    assert budget.context_tokens == LLAMA_CTX and budget.margin_tokens > 0
    session = Session(engine, budget=budget, system_prompt="You are a terse assistant.")
    prose = (
        "I moved to Lisbon in March, I work as a marine biologist studying octopus behaviour, "
        "and on weekends I sail a small boat called Nautilus along the coast. "
    )
    for i in range(5):
        reply = session.send(f"Turn {i}. {prose * 2}What is my boat called?")
        g = reply.stats.generation
        assert g is not None and g.memory_kind == "remote"
        # The server's own count of the prompt (usage.prompt_tokens) plus the reply cap fits.
        assert reply.stats.prompt_tokens == g.prompt_tokens
        assert g.prompt_tokens + budget.max_new_tokens <= LLAMA_CTX, (i, g.prompt_tokens)
        assert 0 < g.new_tokens <= budget.max_new_tokens and reply.text.strip()
    # Summaries run in the background after each reply: bring the last one in first.
    assert session.wait_summary(timeout_s=240).status == "done"
    assert session.summarized_turns >= 2 and session.summary.strip()  # summaries ran remotely
    assert 1.0 <= engine.observed_token_ratio < 1 + 0.25 + 32 / 100  # within the margin


@pytest.mark.slow
def test_llama_cpp_greedy_stream_matches_plain_and_exact_tokenizer(llama_url: str) -> None:
    from convo.engines.local.loading import default_model_path

    engine = OpenAIEngine(
        llama_url, context_window=LLAMA_CTX, tokenizer=default_model_path(), timeouts=Timeouts(call_s=120)
    )
    assert engine.exact_counter and engine.margin_tokens == 0
    msgs = [Message(role=Role.USER, content="Name three colours.")]
    other = [Message(role=Role.SYSTEM, content="Be brief."), *msgs]

    def generate(**kwargs: Any) -> Any:
        # llama.cpp reuses its KV cache for the prompt's longest cached prefix; when the
        # whole prompt is cached it re-evaluates the last token alone, and those logits
        # differ in the last bits from a batched prefill (enough to flip a greedy choice
        # of this 135M model). A different prompt first gives both calls the same prefix.
        engine.generate(other, max_new_tokens=1)
        return engine.generate(msgs, max_new_tokens=24, **kwargs)

    plain = generate()
    pieces: list[str] = []
    streamed = generate(on_text=pieces.append)
    assert plain.text.strip() and streamed.text == plain.text == "".join(pieces)  # greedy
    assert streamed.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert streamed.stats.ttft_s <= streamed.stats.total_s
    # The served model's tokenizer counts the prompt as the server does (give or take BOS).
    assert abs(engine.counter.count_prompt(msgs) - plain.stats.prompt_tokens) <= 1


@pytest.fixture(scope="module")
def llama_tools_url() -> Iterator[str]:
    """llama-cpp-python's server on the default GGUF with ``--chat_format
    chatml-function-calling``: its own ChatML tool prompt, and a grammar that makes the
    model write a call to the function a named ``tool_choice`` asks for (SmolLM2's own
    template knows no tools)."""
    require_llama_cpp()
    from convo.engines.local.loading import default_gguf_path

    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf_path())]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024"]
    cmd += ["--n_threads", "1", "--n_threads_batch", "1", "--chat_format", "chatml-function-calling"]
    base = f"http://127.0.0.1:{port}"
    with process(cmd, f"{base}/v1/models", {}, timeout_s=120):
        yield base


@pytest.mark.slow
def test_llama_cpp_emits_tool_calls_plain_and_streamed(llama_tools_url: str) -> None:
    """The real server: a named tool_choice gives a call to get_weather with JSON arguments,
    the same streamed (llama-cpp-python repeats id and name on every piece) as plain
    (greedy); the call and a tool result go back and the model answers in text."""
    engine = OpenAIEngine(llama_tools_url, context_window=1024, timeouts=Timeouts(call_s=120))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plain = engine.generate(ASK, max_new_tokens=40, tools=[WEATHER], tool_choice=choice)
    assert plain.finish_reason is FinishReason.TOOL_CALLS, plain
    (call,) = plain.tool_calls
    assert call.name == "get_weather" and call.id
    args = call.parsed_arguments
    assert args is not None and isinstance(args.get("city"), str), call.arguments
    texts: list[str] = []
    deltas: list[Any] = []
    streamed = engine.generate(
        ASK,
        max_new_tokens=40,
        tools=[WEATHER],
        tool_choice=choice,
        on_text=texts.append,
        on_tool_call_delta=deltas.append,
    )
    assert streamed.finish_reason is FinishReason.TOOL_CALLS and not "".join(texts).strip()
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(call.name, call.arguments)]
    assert len(deltas) > 1 and [d.name for d in deltas if d.name] == ["get_weather"]
    history = [
        *ASK,
        Message(role=Role.ASSISTANT, content="", tool_calls=plain.tool_calls),
        Message(
            role=Role.TOOL, content='{"temp_c": 18, "sky": "sunny"}', tool_call_id=call.id, name=call.name
        ),
    ]
    final = engine.generate(history, max_new_tokens=24)
    assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and final.text.strip()
