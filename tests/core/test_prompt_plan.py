"""The planner: the budget invariant, shares, caps, tool blocks, oversize policies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convo import Budget, BudgetError, Message, OversizePolicy, Role, Session, ToolCall
from convo.messages import assistant, system, tool, user
from convo.plan import Passage, Turn, passage_message, plan_checked, plan_prompt, summary_message, turn_key
from convo.tokens import CharCounter, TokenCounter


def make_turns(n: int, size: int = 40) -> list[Turn]:
    return [
        Turn(index=i, messages=(user(f"q{i} " + "u" * size), assistant(f"a{i} " + "a" * size)))
        for i in range(n)
    ]


def test_window_keeps_recent_turns_and_reserve(counter: CharCounter) -> None:
    b = Budget(context_tokens=1000, max_new_tokens=100, window_turns=3)
    plan = plan_prompt(budget=b, counter=counter, turns=make_turns(10), pinned=[system("sys")])
    assert plan.turns_shown == (7, 8, 9)
    assert plan.first_shown_turn == 7
    assert plan.parts["reserve"] == 100
    assert plan.prompt_tokens == counter.count_prompt(plan.messages)
    assert plan.total_tokens <= 1000
    assert plan.messages[0].content == "sys"


def test_budget_drops_oldest_whole_turns(counter: CharCounter) -> None:
    # Each turn costs 2 * (4 + 11) = 30 tokens; 3 fit beside overhead 3 + pinned 5.
    turns = make_turns(10)
    cost = sum(counter.message_tokens(m) for m in turns[0].messages)
    room = 3 * cost + counter.overhead_tokens(True) + counter.message_tokens(system("sys"))
    b = Budget(context_tokens=room + 10, max_new_tokens=10, window_turns=8, pinned_tokens=5)
    plan = plan_prompt(budget=b, counter=counter, turns=turns, pinned=[system("sys")])
    assert plan.turns_shown == (7, 8, 9)  # exactly on the limit
    assert plan.total_tokens == b.context_tokens
    b2 = Budget(context_tokens=room + 9, max_new_tokens=10, window_turns=8, pinned_tokens=5)
    plan2 = plan_prompt(budget=b2, counter=counter, turns=turns, pinned=[system("sys")])
    assert plan2.turns_shown == (8, 9)  # one token short: the oldest turn goes


def test_summary_and_retrieval_respect_caps_and_recent_share(counter: CharCounter) -> None:
    b = Budget(
        context_tokens=400,
        max_new_tokens=50,
        window_turns=8,
        summary_tokens=40,
        retrieval_tokens=60,
        retrieval_top_k=2,
        recent_min_tokens=200,
        pinned_tokens=20,
    )
    passages = [Passage(text=f"p{i} " + "p" * 80, score=1.0 - i / 10, source=f"doc{i}") for i in range(5)]
    plan = plan_prompt(budget=b, counter=counter, turns=make_turns(20), summary="s" * 1000, passages=passages)
    header = counter.message_tokens(summary_message(""))
    assert plan.parts["summary"] <= 40 + header
    assert plan.summary_truncated
    assert plan.parts["retrieved"] <= 60
    assert len(plan.passages_used) <= 2
    assert plan.parts["recent"] >= 200
    reasons = {d.reason for d in plan.passages_dropped}
    assert reasons <= {"top_k", "token_cap"} and reasons
    assert plan.total_tokens <= 400


def test_passages_deduplicated_against_window_and_each_other(counter: CharCounter) -> None:
    turns = make_turns(3)
    in_window = Passage(text="whatever", score=0.9, source="turn 2", key=turn_key(2))
    same_text = Passage(text=turns[1].messages[0].content, score=0.8, source="copy")
    dup_a = Passage(text="Fact A", score=0.7, source="x")
    dup_b = Passage(text="fact   a", score=0.6, source="y")
    low = Passage(text="weak", score=0.01, source="z")
    b = Budget(context_tokens=2000, max_new_tokens=100)
    plan = plan_prompt(
        budget=b,
        counter=counter,
        turns=turns,
        passages=[in_window, same_text, dup_a, dup_b, low],
        min_score=0.1,
    )
    assert plan.passages_used == (dup_a,)
    assert [d.reason for d in plan.passages_dropped] == ["in_window", "in_window", "duplicate", "min_score"]
    assert passage_message(dup_a) in plan.messages


def test_grouped_passages_share_one_message_within_the_cap() -> None:
    """Lines tagged with a group (their day) go into one memory message, one label per
    group, in conversation order; the cap holds with the exact count of that message."""
    from convo.plan import GROUP_LABEL, MEMORY_HEADER
    from convo.tokens import TiktokenCounter

    counter = TiktokenCounter("cl100k_base")
    turns = make_turns(3)
    lines = [
        Passage(
            text=f"Ann: fact number {i} " + "x" * (5 + 7 * i),
            score=1.0 - i / 100,
            source="turn",
            key=turn_key(100 + i % 5, i),
            meta={"group": f"{1 + i % 5 // 2} May 2023", "turn": 100 + i % 5, "line": i},
        )
        for i in range(30)
    ]
    doc = Passage(text="a document chunk", score=0.5, source="doc.md:0-10")
    for cap in (60, 150, 400, 5000):
        b = Budget(context_tokens=6000, max_new_tokens=100, retrieval_tokens=cap, retrieval_top_k=40)
        plan = plan_prompt(budget=b, counter=counter, turns=turns, passages=[*lines[:3], doc, *lines[3:]])
        memory = [m for m in plan.messages if m.content.startswith(MEMORY_HEADER)]
        assert len(memory) == 1
        assert plan.parts["retrieved"] <= cap
        assert plan.parts["retrieved"] == sum(
            counter.message_tokens(m) for m in plan.messages if m.role is Role.SYSTEM
        )
        used = [p for p in plan.passages_used if p.meta]
        assert used == lines[: len(used)]  # best first, nothing skipped ahead of a better line
        body = memory[0].content
        for p in used:
            assert p.text in body
        labels = [GROUP_LABEL.format(group=g) for g in {p.meta["group"] for p in used}]
        assert all(body.count(label) == 1 for label in labels)
        # Groups and lines in conversation order (turn, line), whatever the scores.
        positions = [body.index(p.text) for p in sorted(used, key=lambda p: (p.meta["turn"], p.meta["line"]))]
        assert positions == sorted(positions)
        if cap == 5000:
            assert len(used) == 30 and passage_message(doc) in plan.messages


def test_pinned_over_cap_raises(counter: CharCounter) -> None:
    b = Budget(context_tokens=200, max_new_tokens=20, pinned_tokens=10)
    with pytest.raises(BudgetError, match="pinned"):
        plan_prompt(budget=b, counter=counter, turns=make_turns(1), pinned=[system("x" * 100)])


def test_tool_call_block_is_never_split(counter: CharCounter) -> None:
    call = assistant("", tool_calls=[ToolCall(id="c1", name="search", arguments="{}")])
    big_result = tool("r" * 700, tool_call_id="c1")
    msgs = (user("find it"), call, big_result, assistant("x" * 40), user("next?"))
    turns = [Turn(index=0, messages=msgs[:4]), Turn(index=1, messages=msgs[4:])]
    b = Budget(context_tokens=200, max_new_tokens=20, window_turns=4)
    plan = plan_prompt(budget=b, counter=counter, turns=turns)
    assert call not in plan.messages and big_result not in plan.messages
    assert plan.turns_shown == (1,)


def test_newest_turn_drops_middle_blocks_not_its_user_message(counter: CharCounter) -> None:
    blocks = []
    for i in range(6):
        blocks += [
            assistant("", tool_calls=[ToolCall(id=f"c{i}", name="f", arguments="{}")]),
            tool("r" * 80, tool_call_id=f"c{i}"),
        ]
    turn = Turn(index=0, messages=(user("do the task"), *blocks))
    b = Budget(context_tokens=200, max_new_tokens=40, window_turns=2)
    plan = plan_prompt(budget=b, counter=counter, turns=[turn])
    assert plan.messages[0].content == "do the task"
    assert plan.dropped_blocks > 0
    assert plan.messages[-1] == blocks[-1]  # the newest result is kept
    for i, m in enumerate(plan.messages):
        if m.role is Role.TOOL:
            assert plan.messages[i - 1].tool_calls[0].id == m.tool_call_id
    assert plan.total_tokens <= 200


def test_oversize_truncate_and_raise(counter: CharCounter) -> None:
    huge = user("HEAD " + "z" * 4000 + " TAIL")
    b = Budget(context_tokens=300, max_new_tokens=50)
    plan = plan_prompt(budget=b, counter=counter, turns=[Turn(index=0, messages=(huge,))])
    shown = plan.messages[-1].content
    assert plan.truncated_messages == 1
    assert shown.startswith("HEAD") and "tokens omitted" in shown
    assert plan.total_tokens <= 300
    strict = Budget(context_tokens=300, max_new_tokens=50, oversize=OversizePolicy.RAISE)
    with pytest.raises(BudgetError):
        plan_prompt(budget=strict, counter=counter, turns=[Turn(index=0, messages=(huge,))])


# -- property tests -----------------------------------------------------------------------------

texts = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.text(alphabet="абвгдежз日本語のテキスト🙂🚀 \n\t", max_size=200),
    st.text(min_size=500, max_size=3000),
)


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    msgs: list[Message] = []
    for i in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["user", "assistant", "tools"]))
        if kind == "user" or not msgs:
            msgs.append(user(draw(texts)))
        elif kind == "assistant":
            msgs.append(assistant(draw(texts)))
        else:
            n = draw(st.integers(1, 3))
            ids = [f"call{i}_{k}" for k in range(n)]
            msgs.append(
                assistant(draw(texts), tool_calls=[ToolCall(id=x, name="fn", arguments="{}") for x in ids])
            )
            msgs += [tool(draw(texts), tool_call_id=x) for x in ids]
    msgs.append(user(draw(texts)))
    return msgs


budgets = st.builds(
    lambda ctx, frac, window, summ, retr: Budget(
        context_tokens=ctx,
        max_new_tokens=max(1, int(ctx * frac)),
        window_turns=window,
        summary_tokens=summ,
        retrieval_tokens=retr,
    ),
    st.integers(160, 3000),
    st.floats(0.05, 0.5),
    st.integers(1, 10),
    st.integers(0, 200),
    st.integers(0, 300),
)


def check_plan_invariants(session: Session, counter: TokenCounter) -> None:
    plan = session.plan()
    exact = counter.count_prompt(plan.messages)
    assert exact == plan.prompt_tokens
    assert sum(v for k, v in plan.parts.items() if k != "reserve") == plan.prompt_tokens
    assert plan.prompt_tokens + session.budget.max_new_tokens <= session.budget.context_tokens
    pending: set[str] = set()
    for m in plan.messages:
        if m.role is Role.TOOL:
            assert m.tool_call_id in pending, "a tool result was separated from its call"
            pending.discard(m.tool_call_id)
        elif m.role is Role.ASSISTANT:
            pending = {c.id for c in m.tool_calls}
    for p in (m for m in session.messages if m.pinned):
        assert p in plan.messages
    newest_user = [m for m in session.messages if m.role is Role.USER][-1]
    shown_users = [m for m in plan.messages if m.role is Role.USER]
    assert shown_users, "the message being answered must be shown"
    shown = shown_users[-1].content
    if "tokens omitted ...]" in shown:  # truncated: what is left of the head is a true prefix
        head = shown.split("\n[... ")[0]
        # Compare through the tokenizer: some (e.g. GGUF-converted) do not round-trip rare
        # characters, so the head is a prefix of the decoded original, not of the original.
        assert newest_user.content.startswith(head) or counter.decode(
            counter.encode(newest_user.content)
        ).startswith(head)
    else:
        assert shown == newest_user.content


def build_session(counter: TokenCounter, budget: Budget, history: list[Message], summary: str) -> Session:
    session = Session(counter=counter, budget=budget, system_prompt="You are terse.")
    for m in history:
        session.add(m)
    if summary:  # a summary already in the store, as a resumed session finds it
        state, _ = session.store.load(session.id)
        session.store.save_state(replace(state, summary=summary))
        session = Session(
            counter=counter,
            budget=budget,
            store=session.store,
            session_id=session.id,
            system_prompt="You are terse.",
        )
        assert session.summary == summary
    return session


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(history=histories(), budget=budgets, summary=texts)
def test_property_budget_invariant_char_counter(history: list[Message], budget: Budget, summary: str) -> None:
    counter = CharCounter()
    session = build_session(counter, budget, history, summary)
    check_plan_invariants(session, counter)


@pytest.mark.slow
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(history=histories(), budget=budgets, summary=texts)
def test_property_budget_invariant_real_tokenizer(
    smol_counter: TokenCounter, history: list[Message], budget: Budget, summary: str
) -> None:
    """Exact counts through SmolLM2's own tokenizer and chat template."""
    session = build_session(smol_counter, budget, history, summary)
    check_plan_invariants(session, smol_counter)


def test_the_exact_check_keeps_the_margin_free() -> None:
    """A counter whose template costs more than its per-message sum, with a margin (as an
    OpenAIEngine budget has): the checked prompt stays within context - reply - margin."""
    from convo.plan import plan_checked

    class TemplateCounter(CharCounter):
        additive = False

        def count_prompt(self, messages: Sequence[Message]) -> int:
            return super().count_prompt(messages) + 7  # a template cost the sum does not see

    budget = Budget(context_tokens=600, max_new_tokens=32, margin_tokens=160, window_turns=100)
    for size in range(1, 40):  # some sizes fill the room to within the template's 7 tokens
        plan = plan_checked(budget=budget, counter=TemplateCounter(), turns=make_turns(30, size=size))
        assert plan.prompt_tokens <= budget.available_prompt_tokens == 408, size
        assert plan.prompt_tokens == TemplateCounter().count_prompt(plan.messages)


# -- tool schemas: a pinned part -------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_schemas_are_counted_as_a_pinned_part(counter: CharCounter) -> None:
    b = Budget(context_tokens=2000, max_new_tokens=100, window_turns=8)
    turns = make_turns(6)
    bare = plan_prompt(budget=b, counter=counter, turns=turns, pinned=[system("sys")])
    plan = plan_prompt(budget=b, counter=counter, turns=turns, pinned=[system("sys")], tools=[WEATHER_TOOL])
    cost = counter.count_tools([WEATHER_TOOL])
    assert plan.parts["tools"] == cost > 0 and bare.parts["tools"] == 0
    assert plan.prompt_tokens == counter.count_with_tools(plan.messages, [WEATHER_TOOL])
    assert plan.prompt_tokens == sum(v for k, v in plan.parts.items() if k != "reserve")
    assert plan.total_tokens <= b.context_tokens


def test_tool_schemas_take_room_from_the_recent_turns(counter: CharCounter) -> None:
    turns = make_turns(10)
    cost = sum(counter.message_tokens(m) for m in turns[0].messages)
    tools_cost = counter.count_tools([WEATHER_TOOL])
    room = 4 * cost + counter.overhead_tokens(False) + tools_cost // 2
    b = Budget(
        context_tokens=room + 50,
        max_new_tokens=50,
        window_turns=10,
        margin_tokens=0,
        pinned_tokens=tools_cost,
    )
    bare = plan_prompt(budget=b, counter=counter, turns=turns)
    plan = plan_prompt(budget=b, counter=counter, turns=turns, tools=[WEATHER_TOOL])
    assert len(plan.turns_shown) < len(bare.turns_shown)
    assert plan.total_tokens <= b.context_tokens and bare.total_tokens <= b.context_tokens


def test_tool_schemas_over_the_pinned_cap_are_refused(counter: CharCounter) -> None:
    b = Budget(context_tokens=2000, max_new_tokens=100, pinned_tokens=counter.count_tools([WEATHER_TOOL]))
    plan_prompt(budget=b, counter=counter, turns=make_turns(2), tools=[WEATHER_TOOL])  # fits alone
    with pytest.raises(BudgetError, match="tool schema"):
        plan_prompt(
            budget=b, counter=counter, turns=make_turns(2), pinned=[system("sys")], tools=[WEATHER_TOOL]
        )


@pytest.mark.slow
def test_tool_schemas_are_counted_exactly_through_the_real_template(smol_counter: TokenCounter) -> None:
    """A non-additive counter: the plan's prompt is the prompt rendered with the tools."""
    b = Budget(context_tokens=2048, max_new_tokens=128, window_turns=8)
    turns = make_turns(6)
    plan = plan_checked(
        budget=b, counter=smol_counter, turns=turns, pinned=[system("sys")], tools=[WEATHER_TOOL]
    )
    assert plan.prompt_tokens == smol_counter.count_with_tools(plan.messages, [WEATHER_TOOL])
    assert plan.parts["tools"] > 0 and plan.total_tokens <= b.context_tokens


def test_memory_sits_after_the_question_so_the_next_prompt_extends_it(counter: CharCounter) -> None:
    b = Budget(context_tokens=2000, max_new_tokens=50, window_turns=8)
    history = make_turns(3)
    asked = Turn(index=3, messages=(user("where is the key?"),))
    first = plan_prompt(
        budget=b,
        counter=counter,
        turns=[*history, asked],
        passages=[Passage(text="under the mat", score=1.0, source="notes")],
    )
    assert [m.content for m in first.messages[-2:]] == [
        "where is the key?",
        passage_message(first.passages_used[0]).content,
    ]
    answered = Turn(index=3, messages=(*asked.messages, assistant("under the mat")))
    second = plan_prompt(
        budget=b,
        counter=counter,
        turns=[*history, answered, Turn(index=4, messages=(user("and the car?"),))],
        passages=[Passage(text="the car is in the garage", score=1.0, source="notes")],
    )
    # Everything up to the question of the turn before is the same: only its reply, the
    # new question and the new memory are new to an engine that kept the KV cache.
    assert second.messages[: len(first.messages) - 1] == first.messages[:-1]
    assert second.messages[len(first.messages) - 1] == assistant("under the mat")
    assert second.messages[-1].role is Role.SYSTEM and "garage" in second.messages[-1].content


def test_memory_stays_put_while_an_agent_turn_grows(counter: CharCounter) -> None:
    b = Budget(context_tokens=2000, max_new_tokens=50, window_turns=8)
    call = Message(
        role=Role.ASSISTANT, content="", tool_calls=(ToolCall(id="c1", name="look", arguments="{}"),)
    )
    memory = [Passage(text="the key was under the mat", score=1.0, source="notes")]
    step1 = plan_prompt(
        budget=b, counter=counter, turns=[Turn(index=0, messages=(user("find the key"),))], passages=memory
    )
    grown = Turn(index=0, messages=(user("find the key"), call, tool("not in the drawer", tool_call_id="c1")))
    step2 = plan_prompt(budget=b, counter=counter, turns=[grown], passages=memory)
    assert [m.role for m in step2.messages] == [Role.USER, Role.SYSTEM, Role.ASSISTANT, Role.TOOL]
    assert step2.messages[: len(step1.messages)] == step1.messages  # the step extends the last one
