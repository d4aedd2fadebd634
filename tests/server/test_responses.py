"""The Responses API on sessions (``/v1/responses``), through the real ``openai`` SDK and
raw HTTP against a live uvicorn on loopback: function tools with a scripted engine that
emits the model families' own texts through the local engine's parsers, streamed events,
``previous_response_id`` onto the conversation's session (budget, window, summary),
``GET``/``DELETE``, ownership by API key, ``store: false``, and the refusals that name
their field. In every test, what the engine received is checked against the budget."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import serve

from convo import Budget, InMemoryStore
from convo.messages import Message, Role
from convo.server.app import create_app
from convo.stores import Store
from convo.summarize import SummaryWorker
from convo.testing import EchoEngine, ScriptedToolEngine

BUDGET = Budget(context_tokens=6000, max_new_tokens=200, window_turns=4, summary_tokens=0)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK = {
    "type": "function",
    "name": "get_time",
    "description": "The local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
#: Recorded replies as Qwen2.5 / Hermes writes them: a call, a second call, the answer.
HERMES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>',
    "It is sunny in Paris, and 14:05 there.",
]


def app_with(engine: Any, store: Store | None = None, **kw: Any) -> Any:
    kw.setdefault("budget", BUDGET)
    return create_app(engine, store=store if store is not None else InMemoryStore(), model_name="convo", **kw)


def conversation(store: Store, sid: str) -> list[Message]:
    return [m for m in store.load(sid)[1] if not m.pinned]


def held(engine: ScriptedToolEngine, budget: Budget = BUDGET) -> list[int]:
    """The prompt tokens of every call the engine got (tools counted), each checked
    against the budget."""
    sizes = []
    for prompt, tools in zip(engine.prompts, engine.tools_seen, strict=True):
        size = engine.counter.count_with_tools(prompt, tools)
        assert size + budget.max_new_tokens <= budget.context_tokens
        sizes.append(size)
    return sizes


@pytest.fixture
def client_of() -> Iterator[Any]:
    made: list[openai.OpenAI] = []

    def make(base: str, key: str = "x") -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_responses_with_tools_chained_by_previous_response_id(client_of: Any) -> None:
    engine, store = ScriptedToolEngine(HERMES), InMemoryStore()
    with serve(app_with(engine, store)) as base:
        client = client_of(base)
        first = client.responses.create(
            model="convo",
            instructions="Use the tools.",
            input="Weather and time in Paris?",
            tools=[WEATHER, CLOCK],
            metadata={"trip": "paris"},
        )
        assert first.id.startswith("resp_") and first.object == "response"
        assert first.status == "completed" and first.metadata == {"trip": "paris"}
        (call,) = first.output
        assert (call.type, call.name, json.loads(call.arguments)) == (
            "function_call",
            "get_weather",
            {"city": "Paris"},
        )
        assert call.id and call.call_id and call.status == "completed"
        outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}]
        second = client.responses.create(
            model="convo", previous_response_id=first.id, input=outputs, tools=[WEATHER, CLOCK]
        )
        (call2,) = second.output
        assert call2.type == "function_call" and call2.name == "get_time"
        third = client.responses.create(
            model="convo",
            previous_response_id=second.id,
            input=[{"type": "function_call_output", "call_id": call2.call_id, "output": "14:05"}],
            tools=[WEATHER, CLOCK],
        )
        assert third.output_text == "It is sunny in Paris, and 14:05 there."
        assert third.previous_response_id == second.id
        sid = third.model_extra["convo"]["session_id"]
        history = httpx.get(f"{base}/v1/sessions/{sid}").json()["messages"]
    # The engine saw both tools each time, the instructions pinned, and the whole loop.
    assert [[t["function"]["name"] for t in seen or []] for seen in engine.tools_seen] == [
        ["get_weather", "get_time"]
    ] * 3
    last = engine.prompts[-1]
    assert last[0].role is Role.SYSTEM and last[0].content == "Use the tools."
    assert [m.role for m in last[1:]] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.TOOL]
    assert last[2].tool_calls[0].id == call.call_id and last[3].tool_call_id == call.call_id
    # The budget held, and usage says what the model was shown.
    sizes = held(engine)
    for reply, size in zip((first, second, third), sizes, strict=True):
        assert reply.usage is not None and reply.usage.input_tokens == size
        assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert [m["role"] for m in history][1:] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m.role for m in conversation(store, sid)][-1] is Role.ASSISTANT


def test_streamed_events_in_openai_order_and_the_kept_response(client_of: Any) -> None:
    engine = ScriptedToolEngine(["I will check. " + HERMES[0], HERMES[2]])
    with serve(app_with(engine)) as base:
        client = client_of(base)
        events = list(client.responses.create(model="convo", input="Weather?", tools=[WEATHER], stream=True))
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        for kind in (
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ):
            assert kind in kinds, kind
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert text.strip() == "I will check." and json.loads(arguments) == {"city": "Paris"}
        final = events[-1].response
        assert [o.type for o in final.output] == ["message", "function_call"]
        assert final.output[1].arguments == arguments
        added = [e.item.id for e in events if e.type == "response.output_item.added"]
        assert added == [o.id for o in final.output]
        kept = client.responses.retrieve(final.id)
        assert kept.model_dump() == final.model_dump()
        # The tool's result, streamed back as plain text.
        answer = client.responses.create(
            model="convo",
            previous_response_id=final.id,
            input=[{"type": "function_call_output", "call_id": final.output[1].call_id, "output": "sun"}],
            tools=[WEATHER],
            stream=True,
        )
        done = [e for e in answer if e.type == "response.completed"]
    assert done[0].response.output_text == HERMES[2]
    held(engine)


def test_a_long_chain_keeps_the_budget_window_and_summary() -> None:
    """previous_response_id chains run as a session: old turns leave the window, the summary
    folds them, and every prompt stays in the budget (as chat completions' sessions do)."""
    budget = Budget(
        context_tokens=900, max_new_tokens=60, window_turns=2, summarize_batch_turns=1, summary_tokens=80
    )
    seen: list[int] = []

    class Recording(EchoEngine):
        def generate(self, messages: Any, **kw: Any) -> Any:
            seen.append(self.counter.count_prompt(messages))
            return super().generate(messages, **kw)

    worker = SummaryWorker(max_defer_s=0.0)
    store = InMemoryStore()
    try:
        with serve(app_with(Recording(), store, budget=budget, summaries=worker)) as base:
            with httpx.Client(base_url=base) as http:
                previous = None
                for i in range(10):
                    body: dict[str, Any] = {"input": f"Note {i}: my boat is called Nautilus {i}. " * 3}
                    if previous:
                        body["previous_response_id"] = previous
                    r = http.post("/v1/responses", json=body)
                    assert r.status_code == 200, r.text
                    previous = r.json()["id"]
                    sid = r.json()["convo"]["session_id"]
                    job = worker.job(store, sid)
                    if job is not None:
                        job.wait(10)
                stats = r.json()["convo"]
    finally:
        worker.close(wait=False)
    assert len(conversation(store, sid)) == 20  # everything stays stored
    assert stats["evicted_turns"] >= 7 and store.load(sid)[0].summarized_turns >= 5
    assert all(size + budget.max_new_tokens <= budget.context_tokens for size in seen)


def test_get_delete_and_ownership_by_api_key(client_of: Any) -> None:
    engine, store = EchoEngine(), InMemoryStore()
    with serve(app_with(engine, store, api_key=["k1", "k2"])) as base:
        mine, other = client_of(base, "k1"), client_of(base, "k2")
        first = mine.responses.create(model="convo", input="hi")
        second = mine.responses.create(model="convo", input="again", previous_response_id=first.id)
        assert mine.responses.retrieve(first.id).output_text == first.output_text
        for call in (
            lambda: other.responses.retrieve(first.id),
            lambda: other.responses.delete(first.id),
            lambda: other.responses.create(model="convo", input="x", previous_response_id=second.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        sid = second.model_extra["convo"]["session_id"]
        mine.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(first.id)
        assert store.exists(sid)  # the conversation stays while a response of it is kept
        mine.responses.delete(second.id)
        assert not store.exists(sid)  # its last response: the conversation is gone too
        assert store.list_sessions() == []
        with pytest.raises(openai.NotFoundError):
            mine.responses.create(model="convo", input="x", previous_response_id=second.id)
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve("resp_not_one_of_ours")
        generated = httpx.get(f"{base}/metrics").text
    assert "convo_generated_tokens_total" in generated and "convo_generated_tokens_total 0.0" not in generated
    # Two turns ran (the refused ones reached no engine), each prompt inside the budget.
    assert len(engine.prompts) == 2 and engine.prompts[1][-1].content == "again"
    for prompt in engine.prompts:
        assert engine.counter.count_prompt(prompt) + BUDGET.max_new_tokens <= BUDGET.context_tokens


def test_continuing_an_older_response_branches_the_conversation(client_of: Any) -> None:
    """previous_response_id of an older response: the session forks after it (the resend
    rule), the replaced tail stays readable as a fork, and its responses cannot be
    continued any more (400 naming the fork)."""
    engine, store = EchoEngine(), InMemoryStore()
    with serve(app_with(engine, store)) as base:
        client = client_of(base)
        first = client.responses.create(model="convo", input="My name is Ada.")
        tea = client.responses.create(model="convo", input="I like tea.", previous_response_id=first.id)
        coffee = client.responses.create(model="convo", input="I like coffee.", previous_response_id=first.id)
        sid = first.model_extra["convo"]["session_id"]
        fork = coffee.model_extra["convo"]["forked"]
        assert fork == f"{sid}~1"
        # The model saw the branch only: Ada, then coffee, never tea.
        assert [m.content for m in engine.prompts[-1] if m.role is Role.USER] == [
            "My name is Ada.",
            "I like coffee.",
        ]
        assert [m.content for m in conversation(store, sid)][::2] == ["My name is Ada.", "I like coffee."]
        replaced = httpx.get(f"{base}/v1/sessions/{fork}").json()["messages"]
        assert [m["content"] for m in replaced][-2] == "I like tea."
        assert client.responses.retrieve(tea.id).output_text == tea.output_text  # still answered
        with pytest.raises(openai.BadRequestError) as gone:
            client.responses.create(model="convo", input="and?", previous_response_id=tea.id)
        assert gone.value.body["param"] == "previous_response_id" and fork in gone.value.body["message"]  # type: ignore[index]
        after = client.responses.create(
            model="convo", input="What do I like?", previous_response_id=coffee.id
        )
        assert after.model_extra["convo"]["forked"] is None
    users = [m.content for m in engine.prompts[-1] if m.role is Role.USER]
    assert users == ["My name is Ada.", "I like coffee.", "What do I like?"]
    for prompt in engine.prompts:
        assert engine.counter.count_prompt(prompt) + BUDGET.max_new_tokens <= BUDGET.context_tokens


def test_store_false_keeps_nothing(client_of: Any) -> None:
    engine, store = ScriptedToolEngine(HERMES), InMemoryStore()
    with serve(app_with(engine, store)) as base:
        client = client_of(base)
        reply = client.responses.create(model="convo", input="Weather?", tools=[WEATHER], store=False)
        assert reply.output[0].type == "function_call" and reply.store is False
        assert reply.model_extra["convo"]["session_id"] is None
        streamed = list(client.responses.create(model="convo", input="hi", store=False, stream=True))
        assert streamed[-1].type == "response.completed"
        assert store.list_sessions() == []
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(reply.id)
        kept = client.responses.create(model="convo", input="hi", tools=[WEATHER])
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="convo", input="x", previous_response_id=kept.id, store=False)
        assert refused.value.body["param"] == "store"  # type: ignore[index]
    held(engine)


REFUSED = [
    ({"frobnicate": 1}, "frobnicate", 400),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type", 400),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", 400),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", 400),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", 400),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", 400),
    ({"background": True}, "background", 400),
    ({"include": ["file_search_call.results"]}, "include", 400),
    ({"reasoning": {"effort": "high"}}, "reasoning", 400),
    ({"conversation": "conv_1"}, "conversation", 400),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format", 400),
    ({"max_output_tokens": 10_000}, "max_output_tokens", 400),
    ({"stream": "yes"}, "stream", 400),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type", 400),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
        400,
    ),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", 400),
    ({"input": []}, "input", 400),
    ({"previous_response_id": "resp_" + "0" * 48}, "previous_response_id", 404),
]


@pytest.mark.parametrize(("body", "param", "status"), REFUSED, ids=[p for _, p, _ in REFUSED])
def test_refusals_name_the_field_and_store_nothing(body: dict[str, Any], param: str, status: int) -> None:
    engine, store = ScriptedToolEngine(HERMES), InMemoryStore()
    with serve(app_with(engine, store)) as base, httpx.Client(base_url=base) as http:
        response = http.post("/v1/responses", json={"input": "hi", **body})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"]
    assert store.list_sessions() == [] and engine.prompts == []


def test_an_engine_without_tools_refuses_them_naming_tools() -> None:
    store = InMemoryStore()
    with serve(app_with(EchoEngine(), store)) as base, httpx.Client(base_url=base) as http:
        for extra in ({}, {"stream": True}, {"store": False}):
            r = http.post("/v1/responses", json={"input": "hi", "tools": [WEATHER], **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert store.list_sessions() == []


def test_input_items_resent_by_a_client_are_stored_once() -> None:
    """A client that keeps its own items and resends them all (the Agents SDK's default,
    no previous_response_id) gets a new conversation each time; one that chains sends only
    the new items. Either way each prompt holds each message once."""
    engine = ScriptedToolEngine(HERMES)
    with serve(app_with(engine)) as base, httpx.Client(base_url=base) as http:
        items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = http.post("/v1/responses", json={"input": items, "tools": [WEATHER, CLOCK]}).json()
        items += first["output"]
        call = first["output"][0]
        items.append({"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"})
        second = http.post("/v1/responses", json={"input": items, "tools": [WEATHER, CLOCK]}).json()
        assert second["output"][0]["name"] == "get_time"
        assert second["convo"]["session_id"] != first["convo"]["session_id"]
    prompt = engine.prompts[-1]
    assert [m.role for m in prompt] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert prompt[1].tool_calls[0].id == call["call_id"]
    held(engine)


def test_a_dropped_stream_frees_the_session_and_keeps_the_partial_reply() -> None:
    engine, store = EchoEngine(delay_s=0.05, pad_words=100), InMemoryStore()
    with serve(app_with(engine, store)) as base, httpx.Client(base_url=base, timeout=10) as http:
        first = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3}).json()
        body = {"input": "tell me", "previous_response_id": first["id"], "stream": True}
        with http.stream("POST", "/v1/responses", json=body) as stream:
            for line in stream.iter_lines():
                if "output_text.delta" in line:
                    break  # the client goes away mid-reply
        sid = first["convo"]["session_id"]
        started = time.monotonic()
        while True:  # the session's queue is free again soon, not after 100 words
            r = http.delete(f"/v1/sessions/{sid}")
            if r.status_code != 409 or time.monotonic() - started > 3:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 3


def test_a_named_tool_choice_prefills_the_call() -> None:
    """tool_choice {type: function, name} in the Responses shape reaches the engine as the
    chat shape: the reply is the model's continuation after the prefilled call opening."""
    engine = ScriptedToolEngine(['{"city": "Paris"}}\n</tool_call>'])
    with serve(app_with(engine)) as base, httpx.Client(base_url=base) as http:
        body = {
            "input": "Time?",
            "tools": [WEATHER, CLOCK],
            "tool_choice": {"type": "function", "name": "get_time"},
        }
        r = http.post("/v1/responses", json=body).json()
    assert r["tool_choice"] == {"type": "function", "name": "get_time"}
    (call,) = r["output"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_time", {"city": "Paris"})
    # The prefill is part of the prompt the budget counted.
    assert r["usage"]["input_tokens"] > engine.counter.count_with_tools(
        engine.prompts[0], engine.tools_seen[0]
    )
    assert r["usage"]["input_tokens"] + BUDGET.max_new_tokens <= BUDGET.context_tokens


def test_a_failure_after_the_headers_ends_the_stream_with_error_events() -> None:
    class Breaks(EchoEngine):
        def generate(self, messages: Any, **kw: Any) -> Any:
            on_text = kw.get("on_text")
            if on_text is not None:
                on_text("partial")
            raise RuntimeError("the device fell over at /secret/path")

    with serve(app_with(Breaks())) as base, httpx.Client(base_url=base) as http:
        with http.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "response.output_text.delta" in kinds
    assert events[-1]["response"]["status"] == "failed"
    assert "/secret/path" not in json.dumps(events)  # 5xx details go to the log only
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_routes_are_checked_as_chat_completions_are() -> None:
    """API key (401 before the body is read), JSON only (415), body size (413), documented
    in /openapi.json."""
    with serve(app_with(EchoEngine(), api_key="k")) as base, httpx.Client(base_url=base) as http:
        key = {"Authorization": "Bearer k"}
        assert http.post("/v1/responses", json={"input": "hi"}).status_code == 401
        assert http.get("/v1/responses/resp_x").status_code == 401
        form = http.post("/v1/responses", content=b"input=hi", headers={**key, "Content-Type": "text/plain"})
        assert form.status_code == 415
        huge = http.post("/v1/responses", json={"input": "x" * (2 << 20)}, headers=key)
        assert huge.status_code == 413
        paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}"} <= set(paths)
    assert "frobnicate" not in json.dumps(paths["/v1/responses"])
