"""Session logic with a fake engine: storage order, OOM retry, summaries, retrieval, tools."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from typing import Any

import pytest
from conftest import FakeEngine

from convo import Budget, BudgetError, Message, OversizePolicy, Role, Session, ToolCall
from convo.engines.base import Engine
from convo.errors import ConfigError, DeviceOutOfMemory, MessageError, ToolsNotSupported
from convo.messages import assistant, tool, validate_sequence
from convo.models import FinishReason, Generation, GenerationStats
from convo.plan import Passage, Retriever, Turn, turn_key
from convo.summarize import ModelSummarizer, Summarizer
from convo.tokens import CharCounter


class CountingSummarizer(Summarizer):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        self.calls.append(len(messages))
        return (previous + " | " + ";".join(m.content[:10] for m in messages)).strip(" |")


def test_user_message_is_stored_before_generation(fake_engine: FakeEngine) -> None:
    session = Session(fake_engine, budget=Budget(summary_tokens=0))
    fake_engine.fail_with, fake_engine.fail_times = RuntimeError("crash mid-turn"), 1
    with pytest.raises(RuntimeError):
        session.send("remember me")
    assert [m.content for m in session.store.load(session.id)[1]] == ["remember me"]
    reply = session.reply()  # re-run the failed turn
    assert reply.text == "reply 1"
    assert [m.role for m in session.messages] == [Role.USER, Role.ASSISTANT]


def test_oom_retries_once_with_a_smaller_plan(fake_engine: FakeEngine, oom: DeviceOutOfMemory) -> None:
    session = Session(fake_engine, budget=Budget(window_turns=8, summary_tokens=0))
    for i in range(6):
        session.send(f"turn {i}")
    full = session.plan("one more")
    assert len(full.turns_shown) == 7
    fake_engine.fail_with, fake_engine.fail_times = oom, 1
    reply = session.send("one more")
    assert reply.stats.oom_retries == 1
    assert "window_turns=3" in reply.stats.recovery
    assert len(reply.plan.turns_shown) == 3
    assert reply.stats.prompt_tokens < full.prompt_tokens
    assert session.evicted_turns == reply.plan.first_shown_turn  # dropped turns stay reachable
    fake_engine.fail_times = 2
    with pytest.raises(DeviceOutOfMemory):
        session.send("and fail twice")
    assert session.messages[-1].content == "and fail twice"  # kept; nothing corrupted
    assert session.reply().text


def test_bad_input_never_touches_history(fake_engine: FakeEngine) -> None:
    session = Session(
        fake_engine,
        budget=Budget(context_tokens=200, max_new_tokens=20, pinned_tokens=30, oversize=OversizePolicy.RAISE),
    )
    session.send("hello")
    before = session.store.load(session.id)[1]
    with pytest.raises(MessageError):
        session.send(123)  # type: ignore[arg-type]
    with pytest.raises(BudgetError):
        session.send("x" * 5000)
    with pytest.raises(BudgetError):
        session.pin("p" * 500)
    with pytest.raises(MessageError):
        session.add(tool("orphan", tool_call_id="nope"))
    assert session.store.load(session.id)[1] == before


def test_truncate_policy_stores_whole_message(fake_engine: FakeEngine) -> None:
    session = Session(fake_engine, budget=Budget(context_tokens=200, max_new_tokens=20))
    big = "A" * 3000
    reply = session.send(big)
    assert reply.stats.truncated_messages == 1
    assert reply.stats.prompt_tokens + 20 <= 200
    assert session.messages[0].content == big


def test_summary_is_batched_and_capped(fake_engine: FakeEngine) -> None:
    summarizer = CountingSummarizer()
    budget = Budget(window_turns=2, summary_tokens=30, summarize_batch_turns=3)
    session = Session(fake_engine, budget=budget, summarizer=summarizer)
    for i in range(11):
        session.send(f"fact number {i}")
        # Summaries run after the reply, in the background; a job that is still running
        # when the window slides again takes the next batch too. Keep up, for exact counts.
        assert session.wait_summary(timeout_s=10).status == "done"
    # 9 turns left the window; folded 3 at a time, never every turn.
    assert session.evicted_turns == 9
    assert summarizer.calls == [6, 6, 6]
    assert session.summarized_turns == 9
    reply = session.send("last")
    assert reply.plan.parts["summary"] > 0
    assert reply.stats.summary_tokens > 0


def test_pinned_messages_survive_any_history(fake_engine: FakeEngine) -> None:
    session = Session(
        fake_engine,
        budget=Budget(context_tokens=300, max_new_tokens=30, window_turns=2, summary_tokens=0),
        system_prompt="You are terse.",
    )
    session.pin("The user's name is Priya.")
    for i in range(30):
        reply = session.send(f"message {i} " + "y" * 100)
        assert reply.plan.messages[0].content == "You are terse."
        assert reply.plan.messages[1].content == "The user's name is Priya."
        assert reply.stats.prompt_tokens + 30 <= 300


def test_tool_calls_through_a_session(fake_engine: FakeEngine) -> None:
    session = Session(fake_engine, budget=Budget(summary_tokens=0))
    session.add(Message(role="user", content="weather in Lisbon?"))
    session.add(assistant("", tool_calls=[ToolCall(id="w1", name="weather", arguments='{"city": "Lisbon"}')]))
    session.add(tool("21C, sunny", tool_call_id="w1"))
    reply = session.reply()
    sent = fake_engine.prompts[-1]
    assert [m.role for m in sent][-3:] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert reply.text


def test_stream_and_async(fake_engine: FakeEngine) -> None:
    fake_engine.reply_fn = lambda msgs: "streamed reply text"
    session = Session(fake_engine, budget=Budget(summary_tokens=0))
    stream = session.stream("hi")
    chunks = list(stream)
    assert "".join(chunks).strip() == "streamed reply text"
    assert stream.result is not None and stream.result.text == "streamed reply text"
    reply = asyncio.run(session.asend("again"))
    assert reply.stats.turn == 2


class FakeRetriever(Retriever):
    min_score = 0.0

    def __init__(self) -> None:
        self.turns: dict[str, list[Turn]] = {}

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        self.turns.setdefault(session_id, []).extend(turns)

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
        hits = [t for t in self.turns.get(session_id, []) if "secret" in t.messages[0].content]
        return [
            Passage(text=t.messages[0].content, score=1.0, source=f"turn {t.index}", key=turn_key(t.index))
            for t in hits
        ]


def test_evicted_facts_come_back_through_the_retriever(fake_engine: FakeEngine) -> None:
    retriever = FakeRetriever()
    session = Session(fake_engine, budget=Budget(window_turns=2, summary_tokens=0), retriever=retriever)
    session.send("the secret code is 4711")
    for i in range(5):
        session.send(f"small talk {i}")
    assert [t.index for t in retriever.turns[session.id]] == [0, 1, 2, 3, 4]  # each once
    reply = session.send("what was the code?")
    assert [p.source for p in reply.plan.passages_used] == ["turn 0"]
    assert any("4711" in m.content for m in fake_engine.prompts[-1])
    other = Session(fake_engine, retriever=retriever, budget=Budget(summary_tokens=0))
    assert other.send("what was the code?").plan.passages_used == ()


def test_a_turn_retrieves_once(fake_engine: FakeEngine) -> None:
    """A turn plans (and so retrieves) once: the check for a late summary plans only when
    a summary is owed."""
    calls: list[str] = []

    class Counting(FakeRetriever):
        def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
            calls.append(query)
            return super().retrieve(query, session_id=session_id, top_k=top_k)

    for budget in (Budget(window_turns=2, summary_tokens=0), Budget()):
        calls.clear()
        session = Session(fake_engine, budget=budget, retriever=Counting())
        texts = ["the secret code is 4711", *(f"small talk {i}" for i in range(4)), "what was the code?"]
        for text in texts:
            session.send(text)
        assert calls == texts


def test_model_summarizer_never_overflows_the_model_context() -> None:
    engine = FakeEngine(context_window=220)
    engine.reply_fn = lambda msgs: "short summary"
    summarizer = ModelSummarizer(engine=engine)
    msgs = [Message(role="user", content=f"fact {i} " + "w" * 150) for i in range(12)]
    msgs.append(Message(role="user", content="huge " + "h" * 5000))
    out = summarizer.summarize(previous="", messages=msgs, max_tokens=30)
    assert out == "short summary"
    assert len(engine.prompts) > 1  # chunked
    for prompt in engine.prompts:
        assert engine.counter.count_prompt(prompt) + 30 <= 220


def test_window_slides_a_batch_at_a_time_so_prompts_extend(fake_engine: FakeEngine) -> None:
    budget = Budget(window_turns=3, summarize_batch_turns=4, summary_tokens=0)
    session = Session(fake_engine, budget=budget)
    extends = []
    for i in range(20):
        session.send(f"turn {i}")
        if len(fake_engine.prompts) > 1:
            prev, cur = fake_engine.prompts[-2], fake_engine.prompts[-1]
            extends.append(cur[: len(prev)] == prev)
        shown = len(fake_engine.prompts[-1]) // 2 + 1
        assert 3 <= shown <= 3 + 4 - 1 or i < 3
    # The window moves on one turn in four; the other three extend the previous prompt.
    assert [i + 2 for i, e in enumerate(extends) if not e] == [7, 11, 15, 19]


class LyingCounter(CharCounter):
    """Claims to be additive, but the real template costs 7 tokens more."""

    additive = True

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return super().count_prompt(messages) + 7


def test_a_wrong_additive_claim_is_caught_before_the_model() -> None:
    counter = LyingCounter()
    engine = FakeEngine(counter)
    session = Session(
        engine, budget=Budget(context_tokens=120, max_new_tokens=20, window_turns=8, summary_tokens=0)
    )
    for i in range(12):
        reply = session.send(f"message number {i} " + "z" * 40)
        real = counter.count_prompt(engine.prompts[-1])
        assert real + 20 <= 120
        assert reply.stats.prompt_tokens == real


@pytest.mark.parametrize("summary_tokens", [0, 20])
def test_when_the_token_budget_binds_turns_leave_in_batches(
    fake_engine: FakeEngine, summary_tokens: int
) -> None:
    # Each turn is ~30 tokens; the budget holds ~7 of them, far fewer than window_turns.
    budget = Budget(
        context_tokens=300,
        max_new_tokens=40,
        window_turns=20,
        summarize_batch_turns=4,
        summary_tokens=summary_tokens,
    )
    # The summary changes on the same turn as the window, so it costs no extra restart.
    session = Session(fake_engine, budget=budget, summarizer=CountingSummarizer())
    extends = []
    for i in range(40):
        reply = session.send(f"turn {i:02d} " + "w" * 80)
        assert reply.stats.prompt_tokens + 40 <= 300
        assert len(reply.plan.turns_shown) >= min(2, i + 1)
        if len(fake_engine.prompts) > 1:
            prev, cur = fake_engine.prompts[-2], fake_engine.prompts[-1]
            extends.append(cur[: len(prev)] == prev)
    # Without batching every turn past the first few would restart the prompt.
    assert sum(extends[10:]) >= len(extends[10:]) // 2


def test_turn_keywords_are_checked_before_anything_is_stored() -> None:
    """send/reply/asend share one set of keywords (TurnOptions): an unknown one is a
    TypeError before the message is stored; ``stop`` ends the reply in send and asend alike."""
    from convo.testing import EchoEngine

    session = Session(EchoEngine(), budget=Budget(context_tokens=2048, max_new_tokens=32))
    with pytest.raises(TypeError):
        session.send("hello", stops=["x"])  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        session.reply(sampler=None)  # type: ignore[call-arg]
    assert session.messages == []
    assert session.send("hello there", stop=[" there"]).text == "heard 1: hello"
    reply = asyncio.run(session.asend("hi again", stop=[" again"]))
    assert reply.text == "heard 3: hi"


class DatedRetriever(FakeRetriever):
    """A retriever that takes ``today`` and records the dates it is given."""

    supports_today = True

    def __init__(self) -> None:
        super().__init__()
        self.dates: dict[int, str] = {}
        self.asked_on: list[object] = []

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        super().remember_turns(session_id, turns, dates=dates)
        self.dates.update(dates or {})

    def retrieve(self, query: str, *, session_id: str, top_k: int, today: object = None) -> list[Passage]:
        self.asked_on.append(today)
        return super().retrieve(query, session_id=session_id, top_k=top_k)


def test_a_clock_dates_each_turn_and_the_question(fake_engine: FakeEngine) -> None:
    now = [datetime(2026, 11, 30, 9, 0, 41)]
    retriever = DatedRetriever()
    budget = Budget(window_turns=1, summary_tokens=0)
    session = Session(fake_engine, budget=budget, retriever=retriever, clock=lambda: now[0])
    session.send("the secret code is 4711")
    now[0] = datetime(2026, 12, 1, 10, 5)
    session.add(Message(role=Role.USER, content="imported note"), date="8 May 2023")  # explicit wins
    session.add(assistant("ok"))
    session.send("what was the code yesterday?")
    assert retriever.dates == {0: "2026-11-30T09:00", 1: "8 May 2023"}
    assert retriever.asked_on[-1] == "2026-12-01T10:05"  # the asking turn's own date
    session.plan("and now?")
    assert retriever.asked_on[-1] == "2026-12-01T10:05"  # a hypothetical question is asked now
    # A date or a string from the clock; a retriever without ``today`` is not given one.
    plain = FakeRetriever()
    other = Session(fake_engine, budget=budget, retriever=plain, clock=lambda: date(2026, 12, 1))
    for text in ("the secret is here", "small talk", "what was the secret?"):
        other.send(text)  # the retriever is asked without ``today`` (it would raise TypeError)
    assert [t.index for t in plain.turns[other.id]] == [0, 1]
    assert other.turn_dates == {0: "2026-12-01", 1: "2026-12-01", 2: "2026-12-01"}
    with pytest.raises(ConfigError):
        Session(fake_engine, clock="today")  # type: ignore[arg-type]


def test_yesterday_finds_yesterdays_turn_through_retrieval_memory() -> None:
    from conftest import HashEncoder

    from convo.retrieval import RetrievalConfig, RetrievalMemory

    def first_passage(time_weight: float, asked_on: date) -> str:
        now = [date(2026, 11, 20)]
        session = Session(
            counter=CharCounter(),
            retriever=RetrievalMemory(
                HashEncoder(), config=RetrievalConfig(min_score=0.0, time_weight=time_weight)
            ),
            budget=Budget(context_tokens=4096, window_turns=1, summary_tokens=0, retrieval_top_k=1),
            clock=lambda: now[0],
        )
        for day, place in ((20, "lake"), (27, "mill"), (30, "ridge")):
            now[0] = date(2026, 11, day)
            session.add(Message(role=Role.USER, content=f"We hiked to the {place} today."))
            session.add(assistant("Sounds lovely."))
        now[0] = date(2026, 12, 1)
        for i in range(2):  # the window moves on
            session.add(Message(role=Role.USER, content=f"Small talk {i}."))
            session.add(assistant("Sure."))
        now[0] = asked_on
        (passage,) = session.plan("Where did we hike yesterday?").passages_used
        return passage.text

    assert first_passage(0.25, date(2026, 12, 1)) == "user: We hiked to the ridge today."
    assert first_passage(0.25, date(2026, 11, 28)) == "user: We hiked to the mill today."
    # The words alone do not say which day: without the time score the date asked on
    # changes nothing.
    assert first_passage(0.0, date(2026, 12, 1)) == first_passage(0.0, date(2026, 11, 28))


def test_a_resumed_session_dates_its_stored_turns_by_when_they_were_written(fake_engine: FakeEngine) -> None:
    from convo.store import MemoryStore

    store = MemoryStore()
    first = Session(fake_engine, store=store, session_id="s", clock=lambda: "2026-11-30")
    first.add(Message(role=Role.USER, content="hello", created_at=datetime(2026, 11, 30, 8, 15).timestamp()))
    first.add(assistant("hi"))
    resumed = Session(fake_engine, store=store, session_id="s", clock=datetime.now)
    assert resumed.turn_dates == {0: "2026-11-30T08:15"}  # from the message, not the clock
    assert Session(fake_engine, store=store, session_id="s").turn_dates == {}  # no clock, no dates


def test_extended_history_is_dated_by_when_it_was_written(fake_engine: FakeEngine) -> None:
    session = Session(fake_engine, clock=lambda: date(2026, 12, 1))
    old = datetime(2026, 10, 3, 7, 30).timestamp()
    session.extend([{"role": "user", "content": "hi", "created_at": old}, assistant("yo")])
    session.send("and now?")
    assert session.turn_dates == {0: "2026-10-03T07:30", 1: "2026-12-01"}


class RecordingEngine(FakeEngine):
    """Records the options of every generate call."""

    def __init__(self) -> None:
        super().__init__()
        self.options: list[dict[str, object]] = []

    def generate(self, messages: Sequence[Message], **options: object):  # type: ignore[no-untyped-def]
        self.options.append(options)
        return super().generate(messages, **options)  # type: ignore[arg-type]


def test_grouped_settings_and_the_old_keywords_make_the_same_session() -> None:
    from convo.engines.base import Sampling
    from convo.session import ReplyConfig, SummaryConfig
    from convo.summarize import SummaryWorker

    summarizer, worker, sampling = CountingSummarizer(), SummaryWorker(), Sampling(temperature=0.5, seed=1)
    grouped_engine, old_engine = RecordingEngine(), RecordingEngine()
    grouped = Session(
        grouped_engine,
        summarizing=SummaryConfig(summarizer=summarizer, worker=worker, wait_s=0),
        replies=ReplyConfig(sampling=sampling, timeout_s=7.0),
    )
    with pytest.warns(DeprecationWarning) as warned:
        old = Session(
            old_engine,
            summarizer=summarizer,
            summaries=worker,
            summary_wait_s=0,
            sampling=sampling,
            timeout_s=7.0,
        )
    assert len(warned) == 5
    assert "use Session(replies=ReplyConfig(timeout_s=...))" in str(warned[-1].message)
    assert warned[-1].filename == __file__  # the warning points at the caller
    for session, engine in ((grouped, grouped_engine), (old, old_engine)):
        session.send("hi")
        assert session.summarizer is summarizer and session.summaries is worker
        assert session.summary_wait_limit == 0
        assert engine.options[-1]["timeout_s"] == 7.0 and engine.options[-1]["sampling"] == sampling
    worker.close()


def test_grouped_settings_are_validated_and_not_given_twice(fake_engine: FakeEngine) -> None:
    from convo.session import ReplyConfig, SummaryConfig

    for bad in (lambda: ReplyConfig(timeout_s=0), lambda: ReplyConfig(sampling="greedy")):  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="ReplyConfig"):
            bad()
    with pytest.raises(ConfigError, match="summary_wait_s"):
        SummaryConfig(wait_s=-1)
    with pytest.raises(ConfigError, match="both given"):
        Session(fake_engine, replies=ReplyConfig(), timeout_s=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        Session(fake_engine, nonsense=1)  # type: ignore[call-arg]


def test_passage_source_is_a_deprecated_name_of_the_retriever_protocol() -> None:
    import convo.plan
    import convo.session

    with pytest.warns(DeprecationWarning, match=r"convo\.plan\.Retriever"):
        assert convo.plan.PassageSource is convo.plan.Retriever
    assert convo.session.Retriever is convo.plan.Retriever


# -- tools in a turn ----------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


class _ToolEngine(Engine):
    """Calls ``get_weather`` for a user message when offered tools, answers a tool result."""

    supports_tools = True
    counter: Any = None  # (plain attributes, set per instance)
    context_window: int = 0

    def __init__(self) -> None:
        self.counter = CharCounter()
        self.context_window = 100_000
        self.seen: list[dict[str, Any]] = []

    def release(self, cache_key: str) -> None:
        pass

    def generate(self, messages: Sequence[Message], *, max_new_tokens: int, **options: Any) -> Generation:
        tools = options.get("tools")
        prompt = self.counter.count_with_tools(messages, tools)
        assert prompt <= options["max_prompt_tokens"]
        self.seen.append(
            {"messages": tuple(messages), "tools": tools, "prompt": prompt, "reserve": max_new_tokens}
        )
        stats = GenerationStats.untimed(prompt_tokens=prompt, new_tokens=3)
        if tools and messages[-1].role is Role.USER:
            call = ToolCall(id=f"c{len(self.seen)}", name="get_weather", arguments='{"city": "Rome"}')
            return Generation(
                text="", finish_reason=FinishReason.TOOL_CALLS, token_ids=(), stats=stats, tool_calls=(call,)
            )
        return Generation(
            text=f"done {len(self.seen)}", finish_reason=FinishReason.STOP, token_ids=(), stats=stats
        )


def test_a_tool_turn_stores_the_calls_and_plans_the_schemas() -> None:
    engine = _ToolEngine()
    budget = Budget(context_tokens=3000, max_new_tokens=100, summary_tokens=0)
    session = Session(engine, budget=budget)
    reply = asyncio.run(session.asend("weather?", tools=[WEATHER_TOOL], tool_choice="auto"))
    assert reply.finish_reason is FinishReason.TOOL_CALLS
    assert session.messages[-1].tool_calls == reply.tool_calls and reply.tool_calls[0].name == "get_weather"
    assert reply.stats.parts["tools"] == engine.counter.count_tools([WEATHER_TOOL])
    final = session.send([tool("sunny", tool_call_id=reply.tool_calls[0].id)], tools=[WEATHER_TOOL])
    assert final.text == "done 2" and not final.tool_calls
    assert [m.role for m in engine.seen[1]["messages"]][-2:] == [Role.ASSISTANT, Role.TOOL]
    assert all(s["tools"] == (WEATHER_TOOL,) or s["tools"] == [WEATHER_TOOL] for s in engine.seen)
    assert all(s["prompt"] + s["reserve"] <= budget.context_tokens for s in engine.seen)


def test_tools_are_refused_before_anything_is_stored(fake_engine: FakeEngine) -> None:
    session = Session(fake_engine, budget=Budget(summary_tokens=0))
    with pytest.raises(ToolsNotSupported):
        session.send("hi", tools=[WEATHER_TOOL])
    with pytest.raises(ToolsNotSupported):
        session.send("hi", tool_choice="required")
    assert session.messages == [] and fake_engine.prompts == []
    tight = Session(_ToolEngine(), budget=Budget(context_tokens=400, max_new_tokens=50, pinned_tokens=20))
    with pytest.raises(BudgetError, match="tool schema"):
        tight.send("hi", tools=[WEATHER_TOOL])
    with pytest.raises(ConfigError):
        tight.send("hi", tools=[{"type": "function", "function": {}}])
    assert tight.messages == []


def test_a_sliding_window_never_splits_a_tool_block() -> None:
    engine = _ToolEngine()
    budget = Budget(
        context_tokens=2000, max_new_tokens=50, window_turns=2, summarize_batch_turns=1, summary_tokens=0
    )
    session = Session(engine, budget=budget)
    for i in range(6):
        reply = session.send(f"question {i} " + "x" * 40, tools=[WEATHER_TOOL])
        session.send([tool(f"result {i}", tool_call_id=reply.tool_calls[0].id)], tools=[WEATHER_TOOL])
    assert session.evicted_turns > 0
    for seen in engine.seen:
        validate_sequence(list(seen["messages"]))  # every tool result follows its call
        assert seen["prompt"] + seen["reserve"] <= budget.context_tokens


# -- issue 27 #14: a turn reads what is new, not the whole history -----------------------------


def _reads_counting_store(path: object) -> object:
    from convo.stores import SQLiteStore

    class Counting(SQLiteStore):
        """Counts the messages its reads hand back."""

        read = 0

        def load(self, session_id: str):  # type: ignore[no-untyped-def]
            state, messages = super().load(session_id)
            self.read += len(messages)
            return state, messages

        def load_tail(self, session_id: str, after: int):  # type: ignore[no-untyped-def]
            tail = super().load_tail(session_id, after)
            self.read += len(tail.messages)
            return tail

    return Counting(path)  # type: ignore[arg-type]


def test_a_turn_reads_only_what_was_stored_since(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convo.stores import SessionState, SQLiteStore

    budget = Budget(context_tokens=4096, max_new_tokens=32, window_turns=4, summary_tokens=0)
    roles = (Role.USER, Role.ASSISTANT)
    history = [Message(role=roles[i % 2], content=f"m{i}") for i in range(1000)]
    seed = SQLiteStore(tmp_path / "s.db")
    state = SessionState(session_id="s", settings={"budget": budget.to_dict()}, evicted_turns=496)
    seed.create(state, history)
    store = _reads_counting_store(tmp_path / "s.db")
    engine = FakeEngine()
    Session(engine, store=store, session_id="s").send("first")  # the process's first resume reads it all
    for i in range(3):  # a server's turn: a new session object per request
        store.read = 0  # type: ignore[attr-defined]
        reply = Session(engine, store=store, session_id="s").send(f"again {i}")
        assert store.read <= 2  # type: ignore[attr-defined]
        assert reply.plan.first_shown_turn >= 496
    # Another process appends: the next turn reads those messages, and sees them.
    other = SQLiteStore(tmp_path / "s.db")
    Session(engine, store=other, session_id="s").send("from elsewhere")
    store.read = 0  # type: ignore[attr-defined]
    session = Session(engine, store=store, session_id="s")
    assert store.read == 3  # type: ignore[attr-defined]  # the 2 new ones and the last known (still there?)
    assert session.messages[-2].content == "from elsewhere"
    assert len(session.messages) == 1000 + 2 * 5
    # Deleted and created again elsewhere: nothing of the old history is reused.
    other.delete("s")
    Session(engine, store=other, session_id="s").send("new life")
    fresh = Session(engine, store=store, session_id="s")
    assert [m.content for m in fresh.messages][:1] == ["new life"] and len(fresh.messages) == 2


def test_a_first_resume_in_a_new_process_reads_only_the_window(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A session resumed where nothing of it is known (a new process: here a new store
    object on the same file) reads its pinned part and the turns the summary and the
    window still need, not the whole history; the earlier turns are read when asked."""
    from convo.session import SummaryConfig
    from convo.stores import SQLiteStore

    budget = Budget(context_tokens=4096, max_new_tokens=32, window_turns=4, summarize_batch_turns=2)
    summarizer = CountingSummarizer()
    path = tmp_path / "s.db"
    writer = _reads_counting_store(path)
    session = Session(
        FakeEngine(),
        budget=budget,
        store=writer,
        session_id="s",
        system_prompt="be brief",
        summarizing=SummaryConfig(summarizer=summarizer),
    )
    for i in range(100):
        session.send(f"question {i}")
    session.wait_summary(10)
    stored = len(session.messages)
    summarized = session.summarized_turns  # as the store holds it when the session resumes
    assert stored == 1 + 200 and summarized >= 90
    engine = FakeEngine()
    fresh = _reads_counting_store(path)  # nothing of "s" known through this store object
    resumed = Session(engine, store=fresh, session_id="s", summarizing=SummaryConfig(summarizer=summarizer))
    reply = resumed.send("one more")
    # (the turns not summarized at the resume, not after it: the slide this turn makes is
    # summarized in the background, and may be written before this line or after it)
    window = 2 * (resumed.turn_count - summarized)
    assert fresh.read <= window + 2 < 40  # type: ignore[attr-defined]
    assert reply.plan.parts["system"] > 0  # the system prompt came with the window
    assert resumed.turn_count == 101 and reply.stats.turn == 101
    # The whole history is still there for whoever asks (read from the store then).
    assert [m.content for m in resumed.messages][:3] == [
        "be brief",
        "question 0",
        session.messages[2].content,
    ]
    assert len(resumed.messages) == stored + 2
    # What the resumed session shows equals what a session that read everything shows.
    whole = Session(
        engine, store=SQLiteStore(path), session_id="s", summarizing=SummaryConfig(summarizer=summarizer)
    )
    assert [t.messages for t in whole.turns(90)] == [t.messages for t in resumed.turns(90)]
    assert whole.turn_count == resumed.turn_count


def test_a_history_cut_and_regrown_elsewhere_is_read_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Another process cuts the session back (a fork's truncate keeps the epoch) and
    stores more than was there: a session object here that knew the old history must not
    stitch the new tail onto it."""
    from convo.stores import SQLiteStore

    budget = Budget(context_tokens=4096, max_new_tokens=32, window_turns=4, summary_tokens=0)
    here, there = SQLiteStore(tmp_path / "s.db"), SQLiteStore(tmp_path / "s.db")
    engine = FakeEngine()
    session = Session(engine, budget=budget, store=here, session_id="s")
    for i in range(3):
        session.send(f"old {i}")
    state, _ = there.load("s")
    there.truncate("s", 2, state=state)  # as the server's fork does
    other = Session(engine, budget=budget, store=there, session_id="s")
    for i in range(3):
        other.send(f"new {i}")
    truth = [m.content for m in there.load("s")[1]]
    assert len(truth) == 8
    assert [m.content for m in Session(engine, store=here, session_id="s").messages] == truth
    session.send("and here")  # the live object catches up as well
    assert [m.content for m in session.messages][:8] == truth


def test_a_first_resume_reads_only_the_window_on_redis() -> None:
    import uuid

    from conftest import redis_or_skip

    from convo.stores import RedisStore

    url, prefix = redis_or_skip(), f"convo-test:{uuid.uuid4().hex}:"

    class Counting(RedisStore):
        read = 0

        def load(self, session_id: str):  # type: ignore[no-untyped-def]
            state, messages = super().load(session_id)
            self.read += len(messages)
            return state, messages

        def load_tail(self, session_id: str, after: int):  # type: ignore[no-untyped-def]
            tail = super().load_tail(session_id, after)
            self.read += len(tail.messages)
            return tail

    budget = Budget(context_tokens=4096, max_new_tokens=32, window_turns=4, summary_tokens=0)
    writer = RedisStore(url, prefix=prefix)
    session = Session(FakeEngine(), budget=budget, store=writer, session_id="r", system_prompt="be brief")
    for i in range(40):
        session.send(f"question {i}")
    fresh = Counting(url, prefix=prefix)
    resumed = Session(FakeEngine(), store=fresh, session_id="r")
    assert fresh.read < 20 and resumed.turn_count == 40
    assert [t.messages for t in resumed.turns(36)] == [t.messages for t in session.turns(36)]
    assert resumed.messages == session.messages  # the earlier turns, read when asked
    writer.delete("r")
    writer.close()
    fresh.close()


def test_a_chat_that_opens_with_the_assistant_starts_its_own_turn(fake_engine: FakeEngine) -> None:
    """An assistant message right after the previous chat's last reply opens a new turn
    with its own date (it was folded into the previous turn and took that turn's date),
    and a session read back from its store cuts its turns the same way."""
    from convo.stores import MemoryStore

    store = MemoryStore()
    session = Session(fake_engine, store=store, session_id="s", budget=Budget(summary_tokens=0))
    session.add(Message(role=Role.USER, content="I moved to Porto."), date="2026-05-01")
    session.add(assistant("Nice city!"))
    session.add(assistant("Welcome back! How is the new flat?"), date="2026-06-01")
    session.add(Message(role=Role.USER, content="Still unpacking."))
    assert session.turn_count == 3
    assert session.turn_dates == {0: "2026-05-01", 1: "2026-06-01"}
    resumed = Session(fake_engine, store=store, session_id="s", budget=Budget(summary_tokens=0))
    assert resumed.turn_count == 3


def test_an_assistant_message_of_a_new_day_opens_a_turn_after_an_unanswered_question(
    fake_engine: FakeEngine, tmp_path: Any
) -> None:
    """The previous chat ended on a user message nobody answered; the next chat opens with
    the assistant, dated a month later. It opens its own turn with its own date (it used
    to join the old question's turn under the old date), the marker is stored with the
    message, so a session read back from SQLite cuts the same turns, and a same-day reply
    or a reply without a date still joins its question's turn."""
    from convo.stores import SQLiteStore

    store = SQLiteStore(tmp_path / "days.db")
    session = Session(fake_engine, store=store, session_id="d", budget=Budget(summary_tokens=0))
    session.add(Message(role=Role.USER, content="Any tips for Porto?"), date="2026-05-01")
    session.add(assistant("Walk along the river."), date="1 May 2026")  # same day, other spelling
    session.add(Message(role=Role.USER, content="And for food?"), date="2026-05-01")
    session.add(assistant("Welcome back! How was the trip?"), date="2026-06-01")
    session.add(Message(role=Role.USER, content="Great."), date="2026-06-01")
    session.add(assistant("Glad to hear."))
    assert session.turn_count == 4
    assert [len(t.messages) for t in session.turns()] == [2, 1, 1, 2]
    assert session.turn_dates == {0: "2026-05-01", 1: "2026-05-01", 2: "2026-06-01", 3: "2026-06-01"}
    assert [m.opens_turn for m in session.messages] == [False, False, False, True, False, False]
    resumed = Session(fake_engine, store=SQLiteStore(tmp_path / "days.db"), session_id="d")
    assert [len(t.messages) for t in resumed.turns()] == [2, 1, 1, 2]
    assert resumed.messages == session.messages


def test_a_new_days_tool_result_and_its_call_stay_in_their_turn(fake_engine: FakeEngine) -> None:
    """A reply after tool results, and a tool call, stay in their question's turn, whatever
    their date: they answer it."""
    session = Session(fake_engine, budget=Budget(summary_tokens=0))
    session.add(Message(role=Role.USER, content="Weather?"), date="2026-05-01")
    session.add(assistant("", tool_calls=[ToolCall(id="w1", name="weather", arguments="{}")]))
    session.add(tool("sunny", tool_call_id="w1"), date="2026-05-02")
    session.add(assistant("Sunny."), date="2026-05-02")
    assert session.turn_count == 1
    session2 = Session(fake_engine, budget=Budget(summary_tokens=0))
    session2.add(Message(role=Role.USER, content="Weather?"), date="2026-05-01")
    session2.add(
        assistant("", tool_calls=[ToolCall(id="w1", name="weather", arguments="{}")]), date="2026-05-02"
    )
    session2.add(tool("sunny", tool_call_id="w1"), date="2026-05-02")
    assert session2.turn_count == 1


def test_a_reply_after_tool_results_stays_in_its_turn(fake_engine: FakeEngine) -> None:
    session = Session(fake_engine, budget=Budget(summary_tokens=0))
    session.add(Message(role=Role.USER, content="Weather?"))
    session.add(assistant("", tool_calls=[ToolCall(id="w1", name="weather", arguments="{}")]))
    session.add(tool("sunny", tool_call_id="w1"))
    session.add(assistant("Sunny."))
    assert session.turn_count == 1
