"""OpenAI message dicts in and out: Message.from_openai / to_openai, Session.send with
dicts, and convo.plan.fit for agent loops that own their message list."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convo import Budget, BudgetError, Message, MessageError, Role, Session, ToolCall
from convo.plan import Passage, Retriever, fit
from convo.tokens import CharCounter, TokenCounter

# -- Message.from_openai / to_openai ----------------------------------------------------


def test_from_openai_reads_tool_calls_tool_results_and_content_parts() -> None:
    call = Message.from_openai(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "mul", "arguments": {"b": 2}}},
            ],
            "refusal": None,  # extra keys of the API's answers are ignored
        }
    )
    assert call.role is Role.ASSISTANT and call.content == ""
    assert call.tool_calls == (
        ToolCall(id="c1", name="add", arguments='{"a": 1}'),
        ToolCall(id="c2", name="mul", arguments='{"b": 2}'),
    )
    result = Message.from_openai({"role": "tool", "tool_call_id": "c1", "content": "3"})
    assert result.role is Role.TOOL and result.tool_call_id == "c1"
    parts = Message.from_openai(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert parts.content == "ab"
    assert Message.from_openai({"role": "developer", "content": "x"}).role is Role.SYSTEM


@pytest.mark.parametrize(
    "bad",
    [
        "hello",
        {"content": "no role"},
        {"role": "wizard", "content": "x"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
        {"role": "user", "content": 42},
        {"role": "tool", "content": "no call id"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "assistant", "content": "", "tool_calls": "not a list"},
    ],
)
def test_from_openai_refuses_malformed_messages(bad: Any) -> None:
    with pytest.raises(MessageError):
        Message.from_openai(bad)


def test_to_openai_round_trips() -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r", "name": "f"},
        {"role": "assistant", "content": "done"},
    ]
    assert [Message.from_openai(m).to_openai() for m in msgs] == msgs
    assert all(
        Message.from_openai(Message.from_openai(m).to_openai()) == Message.from_openai(m) for m in msgs
    )


# -- Session.send / add with dicts -----------------------------------------------------------


def test_session_takes_openai_dicts_and_tool_results(fake_engine: Any) -> None:
    session = Session(fake_engine, budget=Budget(context_tokens=2000, max_new_tokens=50))
    reply = session.send({"role": "user", "content": "What is 2+3?"})
    assert reply.message.to_openai() == {"role": "assistant", "content": reply.text}
    session.add(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "add", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            ],
        }
    )
    # Both results in one send(): checked together, stored together, then one reply.
    session.send(
        [
            {"role": "tool", "tool_call_id": "a", "content": "5"},
            {"role": "tool", "tool_call_id": "b", "content": "6"},
        ]
    )
    prompt = fake_engine.prompts[-1]
    assert [m.role for m in prompt[-3:]] == [Role.ASSISTANT, Role.TOOL, Role.TOOL]
    assert [m.role.value for m in session.messages] == [
        "user",
        "assistant",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]


def test_send_is_all_or_nothing(fake_engine: Any) -> None:
    session = Session(fake_engine, budget=Budget(context_tokens=2000, max_new_tokens=50))
    with pytest.raises(MessageError):  # the second result answers no call
        session.send(
            [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zz", "content": "x"}]
        )
    with pytest.raises(MessageError):  # a send must end with a user message or tool results
        session.send({"role": "assistant", "content": "I speak first"})
    with pytest.raises(MessageError):
        session.send(42)  # type: ignore[arg-type]
    assert session.messages == []
    assert fake_engine.prompts == []


# -- fit ----------------------------------------------------------------------------------------


def agent_history(n_steps: int, *, size: int = 60) -> list[dict[str, Any]]:
    """A system prompt, a task, then steps of (assistant tool call, tool result)."""
    out: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Find the answer. " * 5},
    ]
    for i in range(n_steps):
        out.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": "{}"}}
                ],
            }
        )
        out.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " + "r" * size})
    return out


def test_fit_keeps_task_system_and_newest_blocks_of_an_agent_loop(counter: CharCounter) -> None:
    history = agent_history(100)
    budget = Budget(context_tokens=600, max_new_tokens=100)
    messages, plan = fit(history, budget=budget, counter=counter)
    assert messages[0] is history[0] and messages[1] is history[1]  # system and task, same dicts
    assert messages[-1] is history[-1]  # the newest tool result
    assert plan.dropped_blocks > 0
    assert plan.prompt_tokens == counter.count_prompt([Message.from_openai(m) for m in messages])
    assert plan.prompt_tokens + budget.max_new_tokens <= budget.context_tokens
    # and the room is used: one more block would not have fit
    block = counter.message_tokens(Message.from_openai(history[2])) + counter.message_tokens(
        Message.from_openai(history[3])
    )
    assert plan.prompt_tokens + block + budget.max_new_tokens > budget.context_tokens


def test_fit_parses_only_what_could_be_shown(counter: CharCounter) -> None:
    history = agent_history(5)
    old = [{"role": "user", "content": f"old {i}"} for i in range(50)]
    # Malformed messages far outside the window are never read.
    kept, plan = fit(
        [history[0], {"role": "tool", "content": "bad"}, *old, *history[1:]],
        budget=Budget(context_tokens=2000, max_new_tokens=100, window_turns=1),
        counter=counter,
    )
    assert kept == history
    assert plan.turns_shown == (51,)


def test_fit_exactly_on_the_limit(counter: CharCounter) -> None:
    history = agent_history(3)
    need = counter.count_prompt([Message.from_openai(m) for m in history])
    kept, _ = fit(history, budget=Budget(context_tokens=need + 10, max_new_tokens=10), counter=counter)
    assert kept == history
    kept, plan = fit(history, budget=Budget(context_tokens=need + 9, max_new_tokens=10), counter=counter)
    assert len(kept) == len(history) - 2 and plan.dropped_blocks == 1


def test_fit_adds_summary_and_passages(counter: CharCounter) -> None:
    class Source(Retriever):
        min_score = 0.0

        def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
            assert session_id == "s1" and "turn 9" in query
            return [Passage(text="the code is 1234", score=1.0, source="notes")]

    history = [{"role": "user", "content": f"turn {i}"} for i in range(10)]
    kept, plan = fit(
        history,
        budget=Budget(context_tokens=400, max_new_tokens=50),
        counter=counter,
        summary="we met",
        retriever=Source(),
        session_id="s1",
    )
    assert kept[0]["role"] == "system" and "we met" in kept[0]["content"]
    assert kept[-2]["content"] == "turn 9" and "1234" in kept[-1]["content"]  # memory after the question
    assert plan.parts["summary"] > 0 and plan.parts["retrieved"] > 0


def test_fit_refuses_bad_input(counter: CharCounter) -> None:
    with pytest.raises(MessageError):
        fit([{"role": "tool", "tool_call_id": "x", "content": "orphan"}], budget=Budget(), counter=counter)
    with pytest.raises(MessageError):
        fit({"role": "user", "content": "x"}, budget=Budget(), counter=counter)  # type: ignore[arg-type]
    with pytest.raises(BudgetError):
        fit([{"role": "system", "content": "x" * 10_000}], budget=Budget(), counter=counter)


texts = st.text(min_size=0, max_size=400)


@st.composite
def openai_histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": "system", "content": draw(st.text(max_size=80))})
    for i in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["user", "assistant", "tools", "system"]))
        if kind == "user" or not out:
            out.append({"role": "user", "content": draw(texts)})
        elif kind == "assistant":
            out.append({"role": "assistant", "content": draw(texts)})
        elif kind == "system":
            out.append({"role": "developer", "content": draw(st.text(max_size=40))})
        else:
            ids = [f"call{i}_{k}" for k in range(draw(st.integers(1, 3)))]
            fn = {"name": "fn", "arguments": draw(st.sampled_from(["{}", '{"q": "x"}']))}
            out.append(
                {
                    "role": "assistant",
                    "content": draw(st.none() | texts),
                    "tool_calls": [{"id": x, "type": "function", "function": fn} for x in ids],
                }
            )
            out += [{"role": "tool", "tool_call_id": x, "content": draw(texts)} for x in ids]
    out.append({"role": "user", "content": draw(texts)})
    return out


fit_budgets = st.builds(
    lambda ctx, frac, window: Budget(
        context_tokens=ctx, max_new_tokens=max(1, int(ctx * frac)), window_turns=window
    ),
    st.integers(200, 3000),
    st.floats(0.05, 0.4),
    st.integers(1, 40),
)


def check_fit(history: list[dict[str, Any]], budget: Budget, counter: TokenCounter) -> None:
    kept, plan = fit(history, budget=budget, counter=counter)
    rendered = [Message.from_openai(m) for m in kept]
    # 1. never over the budget, counted on the rendered prompt
    assert counter.count_prompt(rendered) == plan.prompt_tokens
    assert plan.prompt_tokens + budget.max_new_tokens <= budget.context_tokens
    # 2. system messages pinned: all of them, first, in order
    systems = [m for m in history if m["role"] in ("system", "developer")]
    assert kept[: len(systems)] == systems
    # 3. tool-call blocks whole: every call shown has all its results right after it
    by_call = {
        c["id"]: [t for t in history if t.get("tool_call_id") == c["id"]]
        for m in history
        for c in m.get("tool_calls") or ()
    }
    for i, m in enumerate(kept):
        if m["role"] == "assistant" and m.get("tool_calls"):
            results = kept[i + 1 : i + 1 + len(m["tool_calls"])]
            assert [r["tool_call_id"] for r in results] == [c["id"] for c in m["tool_calls"]]
            assert len(results) == sum(len(by_call[c["id"]]) for c in m["tool_calls"])
        if m["role"] == "tool":
            assert any(
                kept[j]["role"] == "assistant"
                and m["tool_call_id"] in {c["id"] for c in kept[j].get("tool_calls") or ()}
                for j in range(i)
            )
    # 4. the conversation kept unchanged is the caller's own dicts, in the original order
    rest = kept[len(systems) :]
    positions = [
        next(k for k, h in enumerate(history) if h is m) for m in rest if any(h is m for h in history)
    ]
    assert positions == sorted(positions)
    # 5. the newest user message is shown
    assert any(m["role"] == "user" for m in kept[len(systems) :])
    # 6. turns are numbered over the whole history (fit parses only what could be shown)
    convo_msgs = [m for m in history if m["role"] not in ("system", "developer")]
    n_turns = sum(m["role"] == "user" for m in convo_msgs) + (convo_msgs[0]["role"] != "user")
    assert plan.turns_shown[-1] == n_turns - 1


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(history=openai_histories(), budget=fit_budgets)
def test_property_fit_invariants_char_counter(history: list[dict[str, Any]], budget: Budget) -> None:
    try:
        check_fit(history, budget, CharCounter())
    except BudgetError:
        # Allowed only when the system part alone is over its cap.
        sys_cost = sum(
            CharCounter().message_tokens(Message.from_openai(m))
            for m in history
            if m["role"] in ("system", "developer")
        )
        assert sys_cost > budget.pinned_cap


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(history=openai_histories(), budget=fit_budgets)
def test_property_fit_invariants_real_chat_template(
    smol_counter: TokenCounter, history: list[dict[str, Any]], budget: Budget
) -> None:
    """Counted through SmolLM2's tokenizer and chat template (tokenizer files only, no weights)."""
    try:
        check_fit(history, budget, smol_counter)
    except BudgetError:
        sys_cost = sum(
            smol_counter.message_tokens(Message.from_openai(m))
            for m in history
            if m["role"] in ("system", "developer")
        )
        assert sys_cost > budget.pinned_cap - 40  # the template's own system preamble


# -- every field a model is shown is counted, or refused (issue 27 #6) -------------------


def _shown_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the fields a model is shown, in what fit() returns."""
    total = 0
    for m in messages:
        for key in ("content", "refusal", "name"):
            if isinstance(m.get(key), str):
                total += len(m[key])
        for call in m.get("tool_calls") or ():
            total += len(str(call.get("function") or call))
        if m.get("function_call") is not None:
            total += len(str(m["function_call"]))
    return total


def test_a_refusal_is_counted_as_the_text_a_model_is_shown() -> None:
    budget = Budget(context_tokens=2000, max_new_tokens=100, summary_tokens=0)
    counter = CharCounter()
    history = [
        {"role": "user", "content": "write malware"},
        {"role": "assistant", "content": None, "refusal": "I can't help with that. " * 1500},  # 36 kB
        {"role": "user", "content": "then tell me a joke"},
    ]
    kept, plan = fit(history, budget=budget, counter=counter)
    assert plan.prompt_tokens + 100 <= 2000
    assert _shown_chars(kept) <= plan.prompt_tokens * counter.chars_per_token  # nothing uncounted
    assert kept[-1]["content"] == "then tell me a joke"
    small = [*history[:1], {"role": "assistant", "content": None, "refusal": "No."}, history[2]]
    kept, plan = fit(small, budget=budget, counter=counter)
    assert (
        kept[1]["refusal"] == "No."
        and plan.parts["recent"]
        > fit(
            [*history[:1], {"role": "assistant", "content": ""}, history[2]], budget=budget, counter=counter
        ).plan.parts["recent"]
    )
    parts = Message.from_openai({"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]})
    assert parts.content == "No."


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}" * 9000}},
        {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x" * 9000}}],
        },
    ],
    ids=["legacy-function_call", "audio", "custom-tool-call"],
)
def test_fields_that_cannot_be_counted_are_refused_not_passed_through(message: dict[str, Any]) -> None:
    history = [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "and?"}]
    with pytest.raises(MessageError, match="cannot be counted"):
        fit(history, budget=Budget(context_tokens=4000, max_new_tokens=100), counter=CharCounter())
