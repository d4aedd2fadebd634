"""LlamaIndex adapter against the real llama-index-core: a chat engine over ConvoMemory
and a mock LLM that records what reaches it; the prompt never exceeds the budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ToolCallBlock
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.llms.callbacks import llm_chat_callback
from llama_index.core.llms.mock import MockLLM
from pydantic import Field

from convo import Budget, Role
from convo.errors import MessageError
from convo.integrations.llamaindex import ConvoMemory, from_llamaindex, to_llamaindex
from convo.stores import SQLiteStore
from convo.tokens import TokenCounter


class RecordingLLM(MockLLM):
    """MockLLM (answers ``max_tokens`` words) that records every message list it gets."""

    received: list[list[ChatMessage]] = Field(default_factory=list, exclude=True)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        self.received.append(list(messages))
        return super().chat(messages, **kwargs)


def tokens(counter: TokenCounter, messages: list[ChatMessage]) -> int:
    return counter.count_prompt([from_llamaindex(m) for m in messages])


def test_chat_engine_over_convo_memory_stays_in_budget(smol_counter: TokenCounter, tmp_path: Any) -> None:
    budget = Budget(context_tokens=400, max_new_tokens=64)
    store = SQLiteStore(tmp_path / "li.db")
    memory = ConvoMemory.from_defaults(
        session_id="carol", budget=budget, counter=smol_counter, store=store, system_prompt="Be helpful."
    )
    llm = RecordingLLM(max_tokens=40)
    engine = SimpleChatEngine.from_defaults(llm=llm, memory=memory)
    for i in range(10):
        engine.chat(f"Question {i}: " + "which museums open on monday in lisbon " * (15 if i == 6 else 5))
    assert len(llm.received) == 10
    for i, prompt in enumerate(llm.received):
        assert tokens(smol_counter, prompt) + budget.max_new_tokens <= budget.context_tokens
        assert prompt[0].content == "Be helpful."
        assert prompt[-1].content.startswith(f"Question {i}:")
    assert len(llm.received[-1]) < 21  # older turns left the prompt...
    resumed = ConvoMemory(session_id="carol", budget=budget, counter=smol_counter, store=store)
    assert len(resumed.get_all()) == 1 + 20  # ...but every message is stored, once


def test_get_with_input_leaves_room_for_it(smol_counter: TokenCounter) -> None:
    budget = Budget(context_tokens=300, max_new_tokens=50)
    memory = ConvoMemory(session_id="m", budget=budget, counter=smol_counter)
    for i in range(6):
        memory.put(ChatMessage(role="user", content=f"u{i} " + "word " * 30))
        memory.put(ChatMessage(role="assistant", content=f"a{i} " + "word " * 30))
    new = ChatMessage(role="user", content="the new question " * 40)
    without = memory.get()
    with_input = memory.get(input=new.content)
    assert tokens(smol_counter, [*with_input, new]) + budget.max_new_tokens <= budget.context_tokens
    assert tokens(smol_counter, [*without, new]) + budget.max_new_tokens > budget.context_tokens
    memory.put(new)  # once stored, the same input is not counted twice
    assert memory.get(input=new.content)[-1].content == new.content


def test_tool_calls_convert_both_ways(smol_counter: TokenCounter) -> None:
    call = ChatMessage(
        role="assistant",
        blocks=[ToolCallBlock(tool_call_id="c1", tool_name="weather", tool_kwargs={"city": "Porto"})],
    )
    legacy = ChatMessage(
        role="assistant",
        content="",
        additional_kwargs={
            "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        },
    )
    result = ChatMessage(role="tool", content="sunny", additional_kwargs={"tool_call_id": "c1"})
    m = from_llamaindex(call)
    assert m.role is Role.ASSISTANT and m.tool_calls[0].name == "weather"
    assert from_llamaindex(legacy).tool_calls[0].id == "c2"
    assert from_llamaindex(to_llamaindex(m)) == m
    assert from_llamaindex(result).tool_call_id == "c1"
    memory = ConvoMemory(session_id="t", counter=smol_counter)
    memory.put(ChatMessage(role="user", content="weather?"))
    with pytest.raises(MessageError):  # a result answering no call is refused, nothing stored
        memory.put(ChatMessage(role="tool", content="x", additional_kwargs={"tool_call_id": "zz"}))
    memory.put_messages([call, result])
    assert [m.role.value for m in memory.get()] == ["user", "assistant", "tool"]
    memory.reset()
    assert memory.get_all() == []


@pytest.mark.parametrize(
    "bad",
    [
        ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "nobody-called"}),
        ChatMessage(role="function", content="legacy function result"),
    ],
    ids=["orphan-tool-result", "function-role"],
)
def test_set_refusing_a_message_keeps_the_history(tmp_path: Any, bad: ChatMessage) -> None:
    from convo.tokens import CharCounter

    store = SQLiteStore(tmp_path / "set.db")
    memory = ConvoMemory.from_defaults(session_id="s", counter=CharCounter(), store=store)
    for i in range(3):
        memory.put(ChatMessage(role="user", content=f"question {i}"))
        memory.put(ChatMessage(role="assistant", content=f"answer {i}"))
    before = [m.content for m in memory.get_all()]
    assert len(before) == 6
    with pytest.raises(MessageError):
        memory.set([ChatMessage(role="user", content="new"), bad])
    assert [m.content for m in memory.get_all()] == before
    reopened = ConvoMemory.from_defaults(session_id="s", counter=CharCounter(), store=store)
    assert [m.content for m in reopened.get_all()] == before  # the store, too
    memory.set([ChatMessage(role="user", content="new")])
    assert [m.content for m in memory.get_all()] == ["new"]
