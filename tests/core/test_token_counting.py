"""Chat templates that reject a session's prompt shape (several system messages, a summary
and memory in front of the turns): Llama-2's and Mistral's strict alternation, Gemma's
missing system role. The counter folds the prompt into a shape the template accepts, for
counting and for the engine alike (the engine renders through the counter)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from convo import Budget, ConfigError, Session
from convo.messages import Message, Role, ToolCall, assistant, system, tool, user
from convo.plan import Passage, Retriever, Turn
from convo.testing import ScriptedEngine
from convo.tokens import TEMPLATE_FOLDS, HFTokenCounter, estimate_tools_tokens, fold_messages

# Shortened copies of the published templates: the parts that decide what they accept.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' </s>' }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
NOTHING = "{{ raise_exception('this template accepts nothing') }}"


def test_fold_merges_system_messages_and_alternates_turns() -> None:
    msgs = [
        system("pinned"),
        system("summary"),
        user("a"),
        user("b"),
        assistant("c"),
        system("late"),
        user("d"),
    ]
    merged = fold_messages(msgs, "merge-system")
    assert [(m.role, m.content) for m in merged] == [
        (Role.SYSTEM, "pinned\n\nsummary"),
        (Role.USER, "a\n\nb"),
        (Role.ASSISTANT, "c"),
        (Role.USER, "late\n\nd"),
    ]
    folded = fold_messages(msgs, "system-in-user")
    assert [(m.role, m.content) for m in folded] == [
        (Role.USER, "pinned\n\nsummary\n\na\n\nb"),
        (Role.ASSISTANT, "c"),
        (Role.USER, "late\n\nd"),
    ]
    assert fold_messages(msgs, "as-is") == msgs
    assert fold_messages([system("only")], "system-in-user") == [user("only")]
    with pytest.raises(ConfigError, match="fold"):
        fold_messages(msgs, "squash")


def test_fold_keeps_tool_calls_and_tool_results_apart() -> None:
    call = Message(role=Role.ASSISTANT, content="", tool_calls=(ToolCall(id="c1", name="f", arguments="{}"),))
    msgs = [user("q"), call, tool("42", tool_call_id="c1"), tool("43", tool_call_id="c1"), assistant("a")]
    assert fold_messages(msgs, "merge-system") == msgs


class _Memory(Retriever):
    """A retriever that always offers the same passage (the memory message)."""

    min_score = float("-inf")

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        pass

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
        return [Passage(text="The locker code is 4711.", score=1.0, source="notes")]


@pytest.mark.parametrize(
    ("template", "fold"), [(None, "as-is"), (LLAMA2, "merge-system"), (GEMMA, "system-in-user")]
)
def test_sessions_run_under_strict_templates(smol_counter: Any, template: str | None, fold: str) -> None:
    """A session with a system prompt, a rolling summary and memory plans, renders and
    answers under each template, and the budget holds on the exact count."""
    counter = HFTokenCounter(smol_counter.tokenizer, chat_template=template)
    assert counter.fold == fold
    engine = ScriptedEngine(counter)  # counts (renders) every prompt it gets, summaries too
    budget = Budget(context_tokens=512, max_new_tokens=32, window_turns=2, summarize_batch_turns=1)
    session = Session(
        engine, counter=counter, budget=budget, system_prompt="You are terse.", retriever=_Memory()
    )
    for i in range(5):
        session.send(f"Fact {i}: the number is {i * 111}.")
    session.wait_summary(30)
    plan = session.plan("What was fact 0?")
    assert plan.parts["summary"] > 0 and plan.parts["retrieved"] > 0
    assert sum(m.role is Role.SYSTEM for m in plan.messages) >= 3  # pinned, summary, memory
    text = counter.render(plan.messages)
    assert all(m.content.strip() in text for m in plan.messages)  # folded, nothing lost
    assert "You are terse." in text and "4711" in text
    assert plan.prompt_tokens == counter.count_prompt(plan.messages)
    assert plan.prompt_tokens + budget.max_new_tokens <= budget.context_tokens
    assert len(engine.prompts) > 5  # the 5 replies and the summaries, each rendered by the engine


def test_a_template_that_rejects_everything_is_a_typed_error(smol_counter: Any) -> None:
    with pytest.raises(ConfigError, match="chat template rejects"):
        HFTokenCounter(smol_counter.tokenizer, chat_template=NOTHING)
    assert HFTokenCounter(smol_counter.tokenizer, chat_template=GEMMA).fold in TEMPLATE_FOLDS


@pytest.mark.parametrize("template", [LLAMA2, GEMMA])
def test_strict_templates_render_with_tools_and_say_they_ignore_them(
    smol_counter: Any, template: str
) -> None:
    """Strict templates that know no tools still render a folded prompt when tools are
    passed; they say they do not render them, so their tool cost is the estimate."""
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    counter = HFTokenCounter(smol_counter.tokenizer, chat_template=template)
    prompt = [system("Be brief."), user("hi")]
    assert counter.render(prompt, tools=tools) == counter.render(prompt)
    assert not counter.renders_tools
    assert counter.count_tools(tools, prompt) == estimate_tools_tokens(counter, tools)


def test_fold_joins_memory_after_the_question_into_it() -> None:
    call = Message(role=Role.ASSISTANT, content="", tool_calls=(ToolCall(id="c1", name="f", arguments="{}"),))
    msgs = [
        system("pinned"),
        user("a"),
        assistant("b"),
        user("q"),
        system("memory"),
        call,
        tool("r", tool_call_id="c1"),
    ]
    merged = fold_messages(msgs, "merge-system")
    assert [(m.role, m.content) for m in merged[:4]] == [
        (Role.SYSTEM, "pinned"),
        (Role.USER, "a"),
        (Role.ASSISTANT, "b"),
        (Role.USER, "q\n\nmemory"),
    ]
    assert merged[4:] == [call, tool("r", tool_call_id="c1")]
    # The question's own text opens the folded message: the next prompt, which shows the
    # question without memory, shares it as a prefix.
    assert fold_messages([user("q"), system("memory")], "system-in-user") == [user("q\n\nmemory")]
