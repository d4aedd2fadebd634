"""OpenAI Agents adapter against the real openai-agents SDK: Runner with a ConvoSession
and a fake model that records every input it receives, through tool-calling runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, Model, ModelResponse, RunConfig, Runner, Usage, function_tool, set_tracing_disabled
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from convo import Budget, Message, Role
from convo.integrations.openai_agents import ConvoSession, items_to_messages
from convo.tokens import TokenCounter

set_tracing_disabled(True)


class RecordingModel(Model):
    """Calls the ``search`` tool ``tool_steps`` times per run, then answers; records inputs."""

    def __init__(self, tool_steps: int) -> None:
        self.tool_steps = tool_steps
        self.received: list[tuple[str | None, list[Any]]] = []
        self.calls = 0

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        items = [{"role": "user", "content": input}] if isinstance(input, str) else list(input)
        self.received.append((system_instructions, items))
        self.calls += 1
        steps_this_run = sum(
            1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"
        )
        pending = self.calls % (self.tool_steps + 1) != 0 and steps_this_run >= 0
        if pending:
            output: list[Any] = [
                ResponseFunctionToolCall(
                    type="function_call",
                    call_id=f"call_{self.calls}",
                    name="search",
                    arguments=json.dumps({"q": f"step {self.calls}"}),
                    id=f"fc_{self.calls}",
                    status="completed",
                )
            ]
        else:
            text = "Here is what I found about flights to Porto. " * 6
            output = [
                ResponseOutputMessage(
                    id=f"msg_{self.calls}",
                    type="message",
                    role="assistant",
                    status="completed",
                    content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
                )
            ]
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


@function_tool
def search(q: str) -> str:
    """Search flights."""
    return json.dumps({"query": q, "results": [{"flight": f"TP{n}", "price_eur": 40 + n} for n in range(12)]})


def prompt_tokens(counter: TokenCounter, instructions: str | None, items: list[Any]) -> int:
    pinned = [Message(role=Role.SYSTEM, content=instructions)] if instructions else []
    return counter.count_prompt(pinned + [m for m, _ in items_to_messages(items)])


def test_runner_with_convo_session_stays_in_budget(smol_counter: TokenCounter) -> None:
    budget = Budget(context_tokens=1024, max_new_tokens=128)
    model = RecordingModel(tool_steps=3)
    agent = Agent(name="travel", instructions="You book trips.", model=model, tools=[search])
    session = ConvoSession("carol", budget=budget, counter=smol_counter)
    config = RunConfig(call_model_input_filter=session.model_input_filter)

    async def run() -> None:
        for i in range(5):
            await Runner.run(
                agent, f"Trip {i}: find me a flight to Porto " * 4, session=session, run_config=config
            )

    asyncio.run(run())
    assert len(model.received) == 5 * 4  # 3 tool steps and an answer per run
    for instructions, items in model.received:
        assert instructions == "You book trips."
        assert (
            prompt_tokens(smol_counter, instructions, items) + budget.max_new_tokens <= budget.context_tokens
        )
        for k, item in enumerate(items):  # tool results never separated from their call
            if item.get("type") == "function_call_output":
                assert any(
                    i.get("type") == "function_call" and i.get("call_id") == item["call_id"]
                    for i in items[:k]
                )
    # The last call still holds this run's task, and older runs were cut.
    last = model.received[-1][1]
    assert any(i.get("role") == "user" and str(i.get("content", "")).startswith("Trip 4") for i in last)
    assert not any(i.get("role") == "user" and str(i.get("content", "")).startswith("Trip 0") for i in last)
    # Everything is stored, and get_items returns the history fitted into the budget.
    stored = asyncio.run(session.storage.get_items())
    assert sum(1 for i in stored if i.get("role") == "user") == 5
    fitted = asyncio.run(session.get_items())
    assert len(fitted) < len(stored)
    assert prompt_tokens(smol_counter, None, fitted) + budget.max_new_tokens <= budget.context_tokens


def test_without_the_filter_the_model_gets_too_much(smol_counter: TokenCounter) -> None:
    """The control: a plain session lets the run's tool steps overflow (this suite can fail)."""
    budget = Budget(context_tokens=1024, max_new_tokens=128)
    model = RecordingModel(tool_steps=3)
    agent = Agent(name="travel", instructions="You book trips.", model=model, tools=[search])
    session = ConvoSession("dave", budget=budget, counter=smol_counter)

    async def run() -> None:
        for i in range(3):
            await Runner.run(agent, f"Trip {i}: find me a flight to Porto " * 4, session=session)

    asyncio.run(run())
    worst = max(prompt_tokens(smol_counter, ins, items) for ins, items in model.received)
    assert worst + budget.max_new_tokens > budget.context_tokens


def test_parallel_calls_form_one_block() -> None:
    items = [
        {"role": "user", "content": "two searches"},
        {"type": "reasoning", "id": "r1", "summary": []},
        {"type": "function_call", "call_id": "a", "name": "s", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "s", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "2"}]},
    ]
    groups = items_to_messages(items)
    assert [m.role.value for m, _ in groups] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in groups[1][0].tool_calls] == ["a", "b"]
    assert groups[1][1] == items[1:4]  # the reasoning item travels with the calls
    assert groups[3][0].content == "2"


# -- every item that reaches the model is counted (issue 27 #6) ----------------------------


def _reasoning(n: int, size: int) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{n}",
        "summary": [{"type": "summary_text", "text": "Let me think about flights. " * size}],
    }


def _web_search(n: int) -> dict[str, Any]:
    return {
        "type": "web_search_call",
        "id": f"ws_{n}",
        "status": "completed",
        "action": {"type": "search", "query": "flights to Porto " * 200},
    }


def _sent_chars(items: list[Any]) -> int:
    return sum(len(json.dumps(i)) for i in items)


def test_fit_items_counts_reasoning_and_hosted_tool_items() -> None:
    from convo.tokens import CharCounter

    counter = CharCounter()
    budget = Budget(context_tokens=450, max_new_tokens=50, summary_tokens=0)
    session = ConvoSession("s", budget=budget, counter=counter)
    items: list[Any] = []
    for n in range(4):  # ~22k tokens of reasoning and web searches in all
        items += [
            {"role": "user", "content": f"question {n}"},
            _reasoning(n, 600),
            _web_search(n),
            {"role": "assistant", "content": f"answer {n}"},
        ]
    items.append({"role": "user", "content": "and now?"})
    assert _sent_chars(items) > 80_000
    fitted = session.fit_items(items)
    assert session.last_plan is not None
    assert session.last_plan.prompt_tokens + 50 <= 450
    assert _sent_chars(fitted) <= 450 * counter.chars_per_token  # what is sent was counted
    assert fitted[-1] == {"role": "user", "content": "and now?"}
    # A small reasoning item is kept, with the message after it, and counted.
    small = [{"role": "user", "content": "q"}, _reasoning(9, 1), {"role": "assistant", "content": "a"}]
    small.append({"role": "user", "content": "next"})
    kept = session.fit_items(small)
    with_reasoning = session.last_plan.prompt_tokens
    assert kept == small
    session.fit_items([small[0], small[2], small[3]])
    assert with_reasoning > session.last_plan.prompt_tokens


def test_a_shortened_message_leaves_its_uncountable_items_behind() -> None:
    from convo.tokens import CharCounter

    counter = CharCounter()
    budget = Budget(context_tokens=300, max_new_tokens=50, summary_tokens=0)
    session = ConvoSession("s", budget=budget, counter=counter)
    items = [
        {"role": "user", "content": "plan my trip"},
        _reasoning(1, 400),
        {"role": "assistant", "content": "Here is the plan. " * 100},
    ]
    fitted = session.fit_items(items)
    assert session.last_plan is not None and session.last_plan.truncated_messages == 1
    assert [i.get("type", "message") for i in fitted] == ["message", "message"]
    assert fitted[1]["role"] == "assistant" and fitted[1]["content"].startswith("Here is the plan.")
    assert _sent_chars(fitted) <= 300 * counter.chars_per_token
