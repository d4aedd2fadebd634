"""LangChain adapter against the real langchain-core, with a chat model that records what
reaches it: the prompt it receives never exceeds the budget."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory
from pydantic import Field

from convo import Budget
from convo.errors import StoreError
from convo.integrations.langchain import (
    ConvoChatMessageHistory,
    fit_langchain_messages,
    fit_messages,
    from_langchain,
)
from convo.stores import RedisStore, SQLiteStore, Store
from convo.tokens import TokenCounter


class RecordingChatModel(BaseChatModel):
    """Answers with a long fixed text and records every prompt it receives."""

    received: list[list[BaseMessage]] = Field(default_factory=list)
    answer: str = "a reasonably long answer " * 12

    @property
    def _llm_type(self) -> str:
        return "recording"

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        self.received.append(list(messages))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=self.answer))])


def prompt_tokens(counter: TokenCounter, messages: list[BaseMessage]) -> int:
    return counter.count_prompt(from_langchain(messages))


def chain_with_history(
    model: RecordingChatModel, store: SQLiteStore, fitter: Any
) -> RunnableWithMessageHistory:
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a helpful travel agent."), MessagesPlaceholder("history"), ("human", "{input}")]
    )
    return RunnableWithMessageHistory(
        prompt | fitter | model,
        lambda sid: ConvoChatMessageHistory(sid, store=store),
        input_messages_key="input",
        history_messages_key="history",
    )


def test_runnable_with_history_stays_in_budget(smol_counter: TokenCounter, tmp_path: Any) -> None:
    budget = Budget(context_tokens=448, max_new_tokens=64)
    model = RecordingChatModel(received=[])
    store = SQLiteStore(tmp_path / "lc.db")
    chain = chain_with_history(model, store, fit_messages(budget=budget, counter=smol_counter))
    for i in range(8):
        words = 20 if i == 5 else 6
        chain.invoke(
            {"input": f"Question {i}: " + "tell me about the museums in lisbon " * words},
            config={"configurable": {"session_id": "carol"}},
        )
    assert len(model.received) == 8
    for prompt in model.received:
        assert prompt_tokens(smol_counter, prompt) + budget.max_new_tokens <= budget.context_tokens
        assert isinstance(prompt[0], SystemMessage)
        assert prompt[-1].content.startswith(f"Question {model.received.index(prompt)}:")
    # Nothing stored is lost: the history holds every turn, exactly once.
    history = ConvoChatMessageHistory("carol", store=store).messages
    assert [m.type for m in history] == ["human", "ai"] * 8


def test_history_planned_without_the_new_message_breaks_the_budget(
    smol_counter: TokenCounter, tmp_path: Any
) -> None:
    """The failure the adapter exists for (so this test suite can fail): fitting the
    history alone, then adding the new message, goes over the budget."""
    budget = Budget(context_tokens=448, max_new_tokens=64)
    model = RecordingChatModel(received=[])
    store = SQLiteStore(tmp_path / "lc.db")

    def fit_history_only(value: Any) -> list[BaseMessage]:
        msgs = value.to_messages()
        kept, _ = fit_langchain_messages(msgs[:-1], budget=budget, counter=smol_counter)
        return [*kept, msgs[-1]]

    chain = chain_with_history(model, store, fit_history_only)
    for i in range(6):
        words = 20 if i == 5 else 6  # the new message is larger than the room a history leaves
        chain.invoke(
            {"input": f"Question {i}: " + "tell me about the museums in lisbon " * words},
            config={"configurable": {"session_id": "dave"}},
        )
    worst = max(prompt_tokens(smol_counter, p) for p in model.received)
    assert worst + budget.max_new_tokens > budget.context_tokens


def test_tool_calls_round_trip_and_stay_whole(smol_counter: TokenCounter) -> None:
    history = ConvoChatMessageHistory("t1")
    msgs: list[BaseMessage] = [SystemMessage("sys"), HumanMessage("book a flight")]
    for i in range(30):
        msgs.append(AIMessage(content="", tool_calls=[{"id": f"c{i}", "name": "search", "args": {"q": i}}]))
        msgs.append(ToolMessage(content="flight LIS-OPO 42 EUR " * 5, tool_call_id=f"c{i}"))
    history.add_messages(msgs)
    stored = history.messages
    assert [type(m) for m in stored] == [type(m) for m in msgs]
    assert stored[2].tool_calls[0]["args"] == {"q": 0}
    budget = Budget(context_tokens=512, max_new_tokens=64)
    kept, plan = fit_langchain_messages(msgs, budget=budget, counter=smol_counter)
    assert kept[0] is msgs[0] and kept[1] is msgs[1] and kept[-1] is msgs[-1]
    assert plan.dropped_blocks > 0
    for i, m in enumerate(kept):
        if isinstance(m, ToolMessage):
            assert isinstance(kept[i - 1], AIMessage) and kept[i - 1].tool_calls[0]["id"] == m.tool_call_id
    assert prompt_tokens(smol_counter, kept) + budget.max_new_tokens <= budget.context_tokens
    history.clear()
    assert history.messages == []


# -- two writers of one new session (issue 27, defect 7) ----------------------------------

REDIS_URL = os.environ.get("CONVO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

#: Sessions each pair of writers starts together, and messages each writer adds to each.
RACED_SESSIONS, MESSAGES_EACH = 6, 5

#: How long a writer's store takes to answer ``exists``: the time between checking for a
#: session and creating it in which the other writer may create it (a busy host, a store
#: across a network). It makes the race of two first writes happen on every run.
EXISTS_DELAY_S = 0.05


class _SlowExists(Store):
    def exists(self, session_id: str) -> bool:
        found = super().exists(session_id)
        time.sleep(EXISTS_DELAY_S)
        return found


class _SlowSQLiteStore(_SlowExists, SQLiteStore):
    pass


class _SlowRedisStore(_SlowExists, RedisStore):
    pass


def _open(kind: str, where: str, *, slow: bool = False) -> Store:
    if kind == "sqlite":
        return (_SlowSQLiteStore if slow else SQLiteStore)(where)
    return (_SlowRedisStore if slow else RedisStore)(REDIS_URL, prefix=where)


def _history_writer(kind: str, where: str, worker: int, barrier: Any) -> None:
    store = _open(kind, where, slow=True)
    for s in range(RACED_SESSIONS):
        history = ConvoChatMessageHistory(f"new-{s}", store=store)
        barrier.wait(60)  # both writers' first write to the new session at once
        try:
            for k in range(MESSAGES_EACH):
                history.add_messages([HumanMessage(f"{worker}-{k}")])
        except BaseException:
            barrier.abort()  # the other writer stops at its next wait instead of timing out
            raise


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_two_processes_writing_a_new_session_lose_nothing(kind: str, tmp_path: Any) -> None:
    """Two processes write the same new session at once: both create it on their first
    write, neither fails with "already exists", and every message of both is stored."""
    if kind == "sqlite":
        where = str(tmp_path / "race.db")
    else:
        where = f"convo-test:{uuid.uuid4().hex}:"
        try:
            _open(kind, where).ping()
        except (ImportError, StoreError) as exc:
            if os.environ.get("CONVO_REQUIRE_REDIS") == "1":
                pytest.fail(f"CONVO_REQUIRE_REDIS=1 but there is no Redis at {REDIS_URL}: {exc}")
            pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_history_writer, args=(kind, where, w, barrier)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    store = _open(kind, where)
    try:
        assert [p.exitcode for p in procs] == [0, 0]
        for s in range(RACED_SESSIONS):
            stored = [m.content for m in ConvoChatMessageHistory(f"new-{s}", store=store).messages]
            for w in range(2):
                assert [c for c in stored if c.startswith(f"{w}-")] == [
                    f"{w}-{k}" for k in range(MESSAGES_EACH)
                ]
    finally:
        if isinstance(store, RedisStore):
            for key in store._r.scan_iter(match=where + "*"):
                store._r.delete(key)
        store.close()
