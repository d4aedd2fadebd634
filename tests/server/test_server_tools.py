"""Tools through ``convo serve``: chat completions with ``tools`` / ``tool_choice`` /
``parallel_tool_calls``, the assistant's calls and the ``tool`` results stored in the
session, streamed tool-call deltas, and the real clients (openai, LangChain, the Agents
SDK) against a live uvicorn on loopback; plus the ``--engine-url`` path (OpenAIEngine in
front of a second loopback server that answers with tool calls)."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import openai
import pytest
from conftest import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from convo import Budget, InMemoryStore, Session
from convo.engines.base import Engine
from convo.engines.openai import OpenAIEngine
from convo.errors import BudgetError
from convo.messages import Message, Role, ToolCall
from convo.models.generation import FinishReason, Generation, GenerationStats, ToolCallDelta
from convo.server.app import create_app
from convo.stores import Store
from convo.testing import EchoEngine
from convo.tokens import CharCounter

BUDGET = Budget(context_tokens=6000, max_new_tokens=200, window_turns=4, summary_tokens=0)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class ToolEngine(Engine):
    """A scripted engine that declares tools: a user message with tools offered gets a call
    of the first tool (``{"city": "Paris"}``), streamed as deltas when asked; a tool result
    gets the text ``"It is <result>."``. Records every call's prompt and tool arguments."""

    supports_tools = True
    counter: Any = None  # (plain attributes, set per instance)
    context_window: int = 0

    def __init__(self, context_window: int = 100_000) -> None:
        self.counter = CharCounter()
        self.context_window = context_window
        self.calls: list[dict[str, Any]] = []

    def release(self, cache_key: str) -> None:
        pass

    def generate(
        self,
        messages: Sequence[Message],
        *,
        max_new_tokens: int,
        on_text: Callable[[str], None] | None = None,
        on_tool_call_delta: Callable[[ToolCallDelta], None] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        max_prompt_tokens: int | None = None,
        **_: Any,
    ) -> Generation:
        prompt = self.counter.count_with_tools(messages, tools)
        if max_prompt_tokens is not None and prompt > max_prompt_tokens:
            raise BudgetError("rendered prompt over the budget")  # as a real engine does
        self.calls.append(
            {
                "messages": tuple(messages),
                "tools": tools,
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel_tool_calls,
                "prompt_tokens": prompt,
                "max_new_tokens": max_new_tokens,
            }
        )
        last = messages[-1]
        stats = GenerationStats.untimed(prompt_tokens=prompt, new_tokens=5)
        if tools and last.role is Role.USER and tool_choice != "none":
            name = tools[0]["function"]["name"]
            args = json.dumps({"city": "Paris"})
            call = ToolCall(id=f"call_{len(self.calls)}", name=name, arguments=args)
            if on_tool_call_delta is not None:
                on_tool_call_delta(ToolCallDelta(index=0, id=call.id, name=name, arguments=""))
                on_tool_call_delta(ToolCallDelta(index=0, arguments=args[:6]))
                on_tool_call_delta(ToolCallDelta(index=0, arguments=args[6:]))
            return Generation(
                text="", finish_reason=FinishReason.TOOL_CALLS, token_ids=(), stats=stats, tool_calls=(call,)
            )
        text = f"It is {last.content}." if last.role is Role.TOOL else f"heard: {last.content}"
        if on_text is not None:
            for i, word in enumerate(text.split(" ")):
                on_text(word if i == 0 else " " + word)
        return Generation(text=text, finish_reason=FinishReason.STOP, token_ids=(), stats=stats)


def collect_clients() -> None:
    """Finalize the clients a framework test made now, not in the middle of a later test
    (their finalizers, run by the garbage collector inside CPython's AST construction
    during pytest's assertion rewriting, break it: "AST constructor recursion depth
    mismatch")."""
    gc.collect()


def stored(store: Store, sid: str) -> list[Message]:
    return [m for m in store.load(sid)[1] if not m.pinned]


def app_with(engine: Any, store: Store | None = None) -> Any:
    return create_app(engine, store=store or InMemoryStore(), budget=BUDGET, model_name="tools")


def test_a_tool_call_then_its_result_then_the_answer() -> None:
    """Non-streaming two-step loop: the call comes back in OpenAI's shape, the result goes
    into the next prompt beside the call, the tools reach the engine, the budget holds."""
    engine, store = ToolEngine(), InMemoryStore()
    with serve(app_with(engine, store)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        extra = {"metadata": {"session_id": "loop"}}
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(
            model="tools",
            messages=ask,
            tools=[WEATHER],
            tool_choice="auto",
            parallel_tool_calls=False,
            extra_body=extra,
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
            "function",
            "get_weather",
            {"city": "Paris"},
        )
        result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}
        second = client.chat.completions.create(
            model="tools", messages=[result], tools=[WEATHER], extra_body=extra
        )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is sunny, 21C."
    assert second.choices[0].message.tool_calls is None
    # What the engine received: the tools, the choice, and the call with its result.
    one, two = engine.calls
    assert one["tools"] == two["tools"] == [WEATHER]
    assert (one["tool_choice"], one["parallel_tool_calls"]) == ("auto", False)
    prompt = two["messages"]
    assert prompt[-2].role is Role.ASSISTANT and prompt[-2].tool_calls[0].id == call.id
    assert prompt[-1].role is Role.TOOL and prompt[-1].tool_call_id == call.id
    for seen, reply in ((one, first), (two, second)):
        assert seen["prompt_tokens"] + seen["max_new_tokens"] <= BUDGET.context_tokens
        assert reply.usage is not None and reply.usage.prompt_tokens == seen["prompt_tokens"]
    parts = first.model_extra["convo"]["parts"]  # type: ignore[index]
    assert parts["tools"] == CharCounter().count_tools([WEATHER]) > 0
    assert [m.role for m in stored(store, "loop")] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert stored(store, "loop")[1].tool_calls[0].name == "get_weather"


def test_streamed_tool_call_deltas_assemble_into_the_call() -> None:
    engine = ToolEngine()
    with serve(app_with(engine)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        stream = client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            stream=True,
            extra_body={"metadata": {"session_id": "s1"}},
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert calls == {0: {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}}
        # The result, then the answer streamed as text.
        result = {"role": "tool", "tool_call_id": "call_1", "content": "rain"}
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="tools",
                messages=[result],
                tools=[WEATHER],
                stream=True,
                extra_body={"metadata": {"session_id": "s1"}},
            )
            if c.choices
        )
    assert text == "It is rain."


def test_resend_all_stores_each_message_once_tool_messages_included() -> None:
    """A client that resends the whole conversation (the call and the result included)."""
    engine, store = ToolEngine(), InMemoryStore()
    with serve(app_with(engine, store)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        history: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
        ]
        extra = {"metadata": {"session_id": "all"}}
        first = client.chat.completions.create(
            model="tools", messages=history, tools=[WEATHER], extra_body=extra
        )
        history.append(first.choices[0].message.model_dump(exclude_none=True))
        call_id = first.choices[0].message.tool_calls[0].id  # type: ignore[index]
        history.append({"role": "tool", "tool_call_id": call_id, "content": "sunny"})
        second = client.chat.completions.create(
            model="tools", messages=history, tools=[WEATHER], extra_body=extra
        )
        history.append({"role": "assistant", "content": second.choices[0].message.content})
        history.append({"role": "user", "content": "Thanks"})
        third = client.chat.completions.create(
            model="tools", messages=history, tools=[WEATHER], extra_body=extra
        )
    for reply in (first, second, third):  # the resent history matched what was stored
        assert reply.model_extra["convo"]["forked"] is None  # type: ignore[index]
    assert not store.exists("all~1")
    roles = [m.role for m in stored(store, "all")]
    assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.USER, Role.ASSISTANT]
    assert [m.content for m in stored(store, "all")][:4] == ["Weather in Paris?", "", "sunny", "It is sunny."]
    # Each prompt held each message once.
    last_prompt = engine.calls[-1]["messages"]
    assert sum(1 for m in last_prompt if m.role is Role.TOOL) == 1


def test_refusals_name_the_field_and_store_nothing() -> None:
    store = InMemoryStore()
    with serve(app_with(ToolEngine(), store)) as base, httpx.Client(base_url=base) as http:

        def post(**body: Any) -> httpx.Response:
            msgs = [{"role": "user", "content": "hi"}]
            return http.post(
                "/v1/chat/completions", json={"messages": msgs, "metadata": {"session_id": "r"}, **body}
            )

        cases = [
            ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
            ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
            (
                {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                "tool_choice.function.name",
            ),
            ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
            ({"tool_choice": "required"}, "tool_choice"),
        ]
        for body, param in cases:
            response = post(**body)
            assert response.status_code == 400, body
            assert response.json()["error"]["param"] == param
        huge = {"type": "function", "function": {"name": "big", "description": "x " * 14_000}}
        too_big = post(tools=[huge])
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "context_length_exceeded"
        assert "tool schema" in too_big.json()["error"]["message"]
        # Harmless values still pass, as before tools were supported.
        assert post(tools=[], tool_choice="none").status_code == 200
    assert not store.exists("r") or [m.content for m in stored(store, "r")] == ["hi", "heard: hi"]


def test_an_engine_without_tools_answers_400_naming_tools() -> None:
    store = InMemoryStore()
    with serve(app_with(EchoEngine(), store)) as base, httpx.Client(base_url=base) as http:
        for session in ({"metadata": {"session_id": "e"}}, {}, {"stream": True}):
            response = http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **session},
            )
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "tools"
            assert response.json()["error"]["code"] == "unsupported_parameter"
    assert not store.exists("e")


def test_langchain_bind_tools_gets_the_call() -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    engine = ToolEngine()
    with serve(app_with(engine)) as base:
        llm = langchain_openai.ChatOpenAI(base_url=f"{base}/v1", api_key="x", model="tools", max_retries=0)
        message = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
        del llm
    collect_clients()
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    (seen,) = engine.calls
    assert seen["tools"][0]["function"]["name"] == "get_weather"
    assert seen["prompt_tokens"] + seen["max_new_tokens"] <= BUDGET.context_tokens


def test_agents_sdk_chat_completions_model_runs_a_tool_loop() -> None:
    agents = pytest.importorskip("agents")
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        ran.append(city)
        return f"sunny in {city}"

    engine = ToolEngine()
    agents.set_tracing_disabled(True)
    with serve(app_with(engine)) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
        model = agents.OpenAIChatCompletionsModel(model="tools", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Use the tool.", model=model, tools=[get_weather])
        result = agents.Runner.run_sync(agent, "Weather in Paris?")
        del agent, model, client
    collect_clients()
    assert ran == ["Paris"]
    assert result.final_output == "It is sunny in Paris."
    assert len(engine.calls) == 2
    assert engine.calls[1]["messages"][-1].role is Role.TOOL
    assert all(c["prompt_tokens"] + c["max_new_tokens"] <= BUDGET.context_tokens for c in engine.calls)


# -- --engine-url: OpenAIEngine in front of a fake OpenAI-compatible server ----------------------


def upstream_stream() -> bytes:
    """A streamed upstream reply: a few words, then one call in OpenAI's deltas."""
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": "Checking. "},
        {"tool_calls": [{"index": 0, "id": "up_7", "type": "function", "function": {"name": "get_weather"}}]},
        *({"tool_calls": [{"index": 0, "function": {"arguments": a}}]} for a in ('{"ci', 'ty":"Os', 'lo"}')),
    ]
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 9, "total_tokens": 99}})
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()


def fake_upstream(seen: list[dict[str, Any]]) -> Starlette:
    """An OpenAI-compatible server that calls the first tool for a user message and
    answers a tool result in text."""

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        last = body["messages"][-1]
        if body.get("stream"):
            return Response(upstream_stream(), media_type="text/event-stream")
        message: dict[str, Any]
        if body.get("tools") and last["role"] == "user":
            name = body["tools"][0]["function"]["name"]
            call = {
                "id": "up_1",
                "type": "function",
                "function": {"name": name, "arguments": '{"city":"Oslo"}'},
            }
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": f"Upstream: {last['content']}"}, "stop"
        return JSONResponse(
            {
                "id": "up",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127},
            }
        )

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_engine_url_passes_tools_through_and_stores_the_calls() -> None:
    seen: list[dict[str, Any]] = []
    store = InMemoryStore()
    with serve(fake_upstream(seen)) as upstream:
        engine = OpenAIEngine(f"{upstream}/v1", "m", context_window=8192)
        with serve(app_with(engine, store)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
            extra = {"metadata": {"session_id": "up"}}
            ask = [{"role": "user", "content": "Weather in Oslo?"}]
            first = client.chat.completions.create(
                model="tools",
                messages=ask,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                extra_body=extra,
            )
            (call,) = first.choices[0].message.tool_calls or []
            result = {"role": "tool", "tool_call_id": call.id, "content": "snow"}
            second = client.chat.completions.create(
                model="tools", messages=[result], tools=[WEATHER], extra_body=extra
            )
        engine.close()
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.id, call.function.name, call.function.arguments) == (
        "up_1",
        "get_weather",
        '{"city":"Oslo"}',
    )
    assert second.choices[0].message.content == "Upstream: snow"
    one, two = seen
    assert (
        one["tools"] == [WEATHER] and one["tool_choice"] == "required" and one["parallel_tool_calls"] is False
    )
    assert two["messages"][-2]["tool_calls"][0]["id"] == "up_1"
    assert two["messages"][-1] == {"role": "tool", "tool_call_id": "up_1", "content": "snow"}
    for body in seen:
        assert body["max_tokens"] <= BUDGET.max_new_tokens
    kept = stored(store, "up")
    assert [m.role for m in kept] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert kept[1].tool_calls == (ToolCall(id="up_1", name="get_weather", arguments='{"city":"Oslo"}'),)


def test_session_send_refuses_tools_before_storing() -> None:
    """The session itself: tools on an engine without them, or too large, store nothing."""
    session = Session(EchoEngine(), budget=BUDGET)
    with pytest.raises(Exception, match="does not support tools"):
        session.send("hi", tools=[WEATHER])
    assert session.messages == []
    tool_session = Session(ToolEngine(), budget=Budget(context_tokens=600, max_new_tokens=50))
    huge = {"type": "function", "function": {"name": "big", "description": "x " * 500}}
    with pytest.raises(BudgetError):
        tool_session.send("hi", tools=[huge])
    assert tool_session.messages == []
    reply = tool_session.send("hi", tools=[WEATHER])
    assert reply.finish_reason is FinishReason.TOOL_CALLS and reply.tool_calls[0].name == "get_weather"
    assert reply.stats.parts["tools"] == CharCounter().count_tools([WEATHER])
    assert reply.stats.prompt_tokens + reply.stats.max_new_tokens <= 600
    assert reply.message.tool_calls == reply.tool_calls


def test_engine_url_streams_the_upstream_tool_call_deltas() -> None:
    seen: list[dict[str, Any]] = []
    store = InMemoryStore()
    with serve(fake_upstream(seen)) as upstream:
        engine = OpenAIEngine(f"{upstream}/v1", "m", context_window=8192)
        with serve(app_with(engine, store)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
            chunks = list(
                client.chat.completions.create(
                    model="tools",
                    messages=[{"role": "user", "content": "Weather in Oslo?"}],
                    tools=[WEATHER],
                    stream=True,
                    extra_body={"metadata": {"session_id": "ups"}},
                )
            )
        engine.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert text == "Checking. "
    assert [p.id for p in pieces if p.id] == ["up_7"]
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == '{"city":"Oslo"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert seen[0]["stream"] is True and seen[0]["tools"] == [WEATHER]
    (_, answer) = stored(store, "ups")
    assert answer.tool_calls == (ToolCall(id="up_7", name="get_weather", arguments='{"city":"Oslo"}'),)
