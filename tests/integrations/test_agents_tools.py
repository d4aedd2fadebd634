"""Agent frameworks with tools against a live ``convo serve`` on loopback: the OpenAI Agents
SDK with its default Responses model (``Runner.run`` and ``Runner.run_streamed``) and with
``OpenAIChatCompletionsModel``, each running a two-tool loop to its answer; LangChain's
``ChatOpenAI.bind_tools`` (Chat Completions and its Responses API mode). The model is
scripted (``ScriptedToolEngine``): it replays the texts the model families write (Hermes,
Llama 3.1, Mistral) through the local engine's own tool parsers. Each test checks what the
model was shown: the tools, the calls with their results, and the budget."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import serve

from convo import Budget, InMemoryStore
from convo.messages import Role
from convo.server.app import create_app
from convo.testing import ScriptedToolEngine

agents = pytest.importorskip("agents")

BUDGET = Budget(context_tokens=6000, max_new_tokens=200, window_turns=4, summary_tokens=0)
ANSWER = "It is sunny in Paris, and 14:05 there."
#: The same two-step loop as each family writes it: a weather call, a clock call, the answer.
FAMILIES = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>',
        ANSWER,
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_time", "parameters": {"city": "Paris"}}',
        ANSWER,
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "Paris"}}]',
        ANSWER,
    ],
}


@pytest.fixture(autouse=True)
def collect_clients() -> Iterator[None]:
    """Finalize the clients a framework made now, not inside a later test's assertion
    rewriting (their finalizers break CPython's AST construction there)."""
    agents.set_tracing_disabled(True)
    yield
    gc.collect()


def the_tools(ran: list[str]) -> list[Any]:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        ran.append(f"weather:{city}")
        return f"sunny in {city}"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time of a city."""
        ran.append(f"time:{city}")
        return "14:05"

    return [get_weather, get_time]


def check_what_the_model_saw(engine: ScriptedToolEngine, calls: int = 3) -> None:
    """Both tools offered each time; the last prompt holds both calls with their results;
    each prompt (tools included) within the budget."""
    assert len(engine.prompts) == calls
    for seen in engine.tools_seen:
        assert [t["function"]["name"] for t in seen or []] == ["get_weather", "get_time"]
    last = engine.prompts[-1]
    assert [m.role for m in last if m.role is not Role.SYSTEM] == [
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.ASSISTANT,
        Role.TOOL,
    ]
    assert [m.content for m in last if m.role is Role.TOOL] == ["sunny in Paris", "14:05"]
    for prompt, tools in zip(engine.prompts, engine.tools_seen, strict=True):
        assert engine.counter.count_with_tools(prompt, tools) + BUDGET.max_new_tokens <= BUDGET.context_tokens


def app_for(family: str) -> tuple[Any, ScriptedToolEngine]:
    engine = ScriptedToolEngine(FAMILIES[family], parser=family)
    return create_app(engine, store=InMemoryStore(), budget=BUDGET, model_name="convo"), engine


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_default_responses_model_runs_a_two_tool_loop(streamed: bool) -> None:
    ran: list[str] = []
    app, engine = app_for("hermes")
    with serve(app) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        # The SDK's default provider: a model name becomes OpenAIResponsesModel (/v1/responses).
        config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client))
        agent = agents.Agent(name="trip", instructions="Use the tools.", model="convo", tools=the_tools(ran))
        if streamed:
            result = asyncio.run(run_streamed(agent, config))
        else:
            # (asyncio.run, not run_sync: a fresh loop, not the thread's default one that an
            # earlier test may have shut down the async generators of)
            result = asyncio.run(agents.Runner.run(agent, "Weather and time in Paris?", run_config=config))
        assert isinstance(agent.model, str)  # resolved by the provider: the default model
        del agent, client, config
    assert ran == ["weather:Paris", "time:Paris"]
    assert result.final_output == ANSWER
    assert engine.prompts[0][0].content == "Use the tools."
    check_what_the_model_saw(engine)


async def run_streamed(agent: Any, config: Any) -> Any:
    """``Runner.run_streamed`` to its end: the model's Responses events come through."""
    result = agents.Runner.run_streamed(agent, "Weather and time in Paris?", run_config=config)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds
    return result


def test_agents_sdk_chat_completions_model_runs_a_two_tool_loop() -> None:
    ran: list[str] = []
    app, engine = app_for("llama3_json")
    with serve(app) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="convo", openai_client=client)
        agent = agents.Agent(name="trip", instructions="Use the tools.", model=model, tools=the_tools(ran))
        result = asyncio.run(agents.Runner.run(agent, "Weather and time in Paris?"))
        del agent, model, client
    assert ran == ["weather:Paris", "time:Paris"]
    assert result.final_output == ANSWER
    check_what_the_model_saw(engine)


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat_completions", "responses"])
def test_langchain_bind_tools_runs_the_loop(responses_api: bool) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    def get_weather(city: str) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    def get_time(city: str) -> str:
        """The local time of a city."""
        return "14:05"

    tools = {"get_weather": get_weather, "get_time": get_time}
    app, engine = app_for("mistral")
    with serve(app) as base:
        llm = langchain_openai.ChatOpenAI(
            base_url=f"{base}/v1", api_key="x", model="convo", max_retries=0, use_responses_api=responses_api
        )
        bound = llm.bind_tools([get_weather, get_time])
        messages: list[Any] = [HumanMessage("Weather and time in Paris?")]
        for _ in range(3):
            reply = bound.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                messages.append(ToolMessage(tools[call["name"]](**call["args"]), tool_call_id=call["id"]))
        del llm, bound
    assert [c["name"] for m in messages for c in getattr(m, "tool_calls", [])] == ["get_weather", "get_time"]
    assert messages[-1].text == ANSWER
    check_what_the_model_saw(engine)
