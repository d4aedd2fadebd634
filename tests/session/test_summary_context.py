"""Summaries written as the continuation of the session's own prompt (issue 22).

After a reply, the turns that leave the window sit in the prompt just answered, right after
its pinned part and the summary. A summary written as that prompt's continuation (the
prompt up to those turns, then an instruction) lets a KV-caching engine reuse the session's
cached KV: it prefills the instruction alone instead of the turns again. These tests check
which prompts qualify (:func:`~convo.session.summaries.prompt_context`), that the default
summarizer uses it and falls back to its template otherwise, and, with the default model on
CPU, that the summary call really prefills only its instruction."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from conftest import FakeEngine

from convo import Budget, Session
from convo.errors import ConfigError
from convo.messages import Message, Role
from convo.models import Generation, Priority
from convo.plan import Passage, passage_message, summary_message
from convo.session import SummaryConfig
from convo.session.summaries import prompt_context
from convo.summarize import DEFAULT_TEMPLATE, ModelSummarizer, Summarizer, SummaryStatus, SummaryWorker

WAIT = 10.0


def user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def bot(text: str) -> Message:
    return Message(role=Role.ASSISTANT, content=text)


SYSTEM = Message(role=Role.SYSTEM, content="You are helpful.")
TURNS = [user("u0"), bot("a0"), user("u1"), bot("a1"), user("u2"), bot("a2")]


def test_the_prompt_up_to_the_folded_turns_is_the_context() -> None:
    prompt = [SYSTEM, summary_message("s"), *TURNS, user("now")]
    assert prompt_context(prompt, TURNS[:4], "s") == (SYSTEM, summary_message("s"), *TURNS[:4])
    # No summary yet: the turns follow the pinned part.
    first = [SYSTEM, *TURNS, user("now")]
    assert prompt_context(first, TURNS[:2], "") == (SYSTEM, *TURNS[:2])


def test_a_prompt_that_does_not_show_the_turns_after_that_summary_gives_none() -> None:
    prompt = [SYSTEM, summary_message("s"), *TURNS, user("now")]
    assert prompt_context(prompt, TURNS[:4], "another summary") == ()  # it showed another one
    assert prompt_context([SYSTEM, *TURNS], TURNS[:2], "s") == ()  # it showed none
    assert prompt_context([SYSTEM, summary_message("s"), *TURNS], TURNS[:2], "") == ()
    cut = [SYSTEM, summary_message("s"), user("u0 (cut)"), *TURNS[1:]]
    assert prompt_context(cut, TURNS[:2], "s") == ()  # a folded message was shortened
    assert prompt_context([SYSTEM, summary_message("s"), *TURNS[2:]], TURNS[:4], "s") == ()
    passage = passage_message(Passage(text="p", score=1.0, source="doc"))
    between = [SYSTEM, summary_message("s"), *TURNS[:2], passage, *TURNS[2:]]
    assert prompt_context(between, TURNS[:4], "s") == ()  # a passage sits between them
    assert prompt_context([SYSTEM, *TURNS], [], "") == ()


class Recording(FakeEngine):
    """A fake engine that records the prompts of background (summary) calls."""

    def __init__(self) -> None:
        super().__init__()
        self.summary_prompts: list[list[Message]] = []

    def generate(self, messages: Sequence[Message], **kw: object) -> Generation:  # type: ignore[override]
        if kw.get("priority") == Priority.BACKGROUND:
            self.summary_prompts.append(list(messages))
        return super().generate(messages, **kw)  # type: ignore[arg-type]


def test_the_default_summarizer_continues_the_session_prompt() -> None:
    engine = Recording()
    worker = SummaryWorker(max_defer_s=0.0)
    budget = Budget(window_turns=1, summarize_batch_turns=1, summary_tokens=40)
    try:
        session = Session(
            engine,
            budget=budget,
            system_prompt="You are helpful.",
            summarizing=SummaryConfig(worker=worker, wait_s=0),
        )
        replies = []
        for i in range(3):
            replies.append(session.send(f"fact {i}"))
            assert session.wait_summary(WAIT).status is SummaryStatus.DONE
        assert len(engine.summary_prompts) == 3  # each turn folds the one before (lookahead)
        for prompt in engine.summary_prompts:
            # The session's prompt (pinned part, summary shown, the folded turns), then the
            # instruction: never the template with the turns pasted in again.
            assert prompt[0].role is Role.SYSTEM and prompt[0].content == "You are helpful."
            assert prompt[-1].content.startswith("Summarize the conversation above")
            assert not any(m.content.startswith("Earlier summary:") for m in prompt)
        # The first summary folds turn 0, exactly as the first turn's prompt and reply showed it.
        first = engine.summary_prompts[0]
        assert [m.content for m in first[1:-1]] == ["fact 0", replies[0].text]
    finally:
        worker.close()


def test_without_a_context_or_with_no_room_the_template_folds_the_turns() -> None:
    engine = FakeEngine()
    seen: list[list[Message]] = []
    original = engine.generate

    def generate(messages: Sequence[Message], **kw: object) -> Generation:
        seen.append(list(messages))
        return original(messages, **kw)  # type: ignore[arg-type]

    engine.generate = generate  # type: ignore[method-assign]
    summarizer = ModelSummarizer(engine=engine, max_input_tokens=400)
    turns = [user("my boat is Nautilus"), bot("noted")]
    summarizer.summarize(previous="", messages=turns, max_tokens=40)
    assert seen[-1][-1].content.startswith("Earlier summary:")  # no context: the template
    huge = [SYSTEM, user("x " * 2000), *turns]  # the context does not fit the 400 tokens
    summarizer.summarize(previous="", messages=turns, max_tokens=40, context=huge)
    assert seen[-1][-1].content.startswith("Earlier summary:")
    summarizer.summarize(previous="", messages=turns, max_tokens=40, context=[SYSTEM, *turns])
    assert seen[-1][:-1] == [SYSTEM, *turns] and seen[-1][-1].content.startswith("Summarize")


def test_a_template_of_your_own_is_used_for_every_summary() -> None:
    mine = "Notes so far: {previous}\n{conversation}\nAt most {max_words} words."
    engine = FakeEngine()
    assert ModelSummarizer(engine=engine).supports_context
    assert ModelSummarizer(engine=engine, template=DEFAULT_TEMPLATE).supports_context
    assert not ModelSummarizer(engine=engine, template=mine).supports_context
    assert ModelSummarizer(engine=engine, template=mine, reuse_prompt=True).supports_context
    assert not ModelSummarizer(engine=engine, reuse_prompt=False).supports_context
    with pytest.raises(ConfigError, match="max_words"):
        ModelSummarizer(engine=engine, context_instruction="Summarize.")


def test_a_summarizer_that_does_not_declare_context_is_called_without_it() -> None:
    calls: list[dict[str, object]] = []
    done = threading.Event()

    class Plain(Summarizer):  # written before supports_context: never given context=
        def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
            calls.append({"previous": previous, "n": len(messages)})
            done.set()
            return "plain summary"

    worker = SummaryWorker(max_defer_s=0.0)
    budget = Budget(window_turns=1, summarize_batch_turns=1, summary_tokens=40)
    try:
        session = Session(
            FakeEngine(),
            budget=budget,
            summarizing=SummaryConfig(summarizer=Plain(), worker=worker, wait_s=0),
        )
        for i in range(3):
            session.send(f"fact {i}")
        assert done.wait(WAIT)
        state = session.wait_summary(WAIT)
        # (Once seen PENDING under a loaded CI machine, cause not found: the state says more.)
        assert state.status is SummaryStatus.DONE, (state, worker.stats(), session.summary_state)
        assert calls and session.summary == "plain summary"
    finally:
        worker.close()


@pytest.mark.slow
def test_with_the_default_model_a_summary_prefills_only_its_instruction(real_engine: object) -> None:
    """On CPU (the default engine's own KV reuse), the summary of the turns that left the
    window reads them from the session's cached KV: its prefill is the instruction alone."""
    stats = []
    original = real_engine.generate  # type: ignore[attr-defined]

    def generate(messages: Sequence[Message], **kw: object) -> Generation:
        result = original(messages, **kw)
        if kw.get("priority") == Priority.BACKGROUND:
            stats.append(result.stats)
        return result

    worker = SummaryWorker(max_defer_s=0.0)
    budget = Budget(
        context_tokens=1024, max_new_tokens=24, window_turns=2, summarize_batch_turns=2, summary_tokens=64
    )
    try:
        real_engine.generate = generate  # type: ignore[attr-defined]
        session = Session(
            real_engine,  # type: ignore[arg-type]
            budget=budget,
            summarizing=SummaryConfig(worker=worker, wait_s=0),
        )
        for text in (
            "My boat is called Nautilus and it is moored in Brest.",
            "I keep three beehives in my garden.",
            "My sister Clara lives in Lyon.",
            "I am allergic to peanuts.",
        ):
            session.send(text)
            session.wait_summary(300)
        assert session.summary_state.status is SummaryStatus.DONE and session.summary.strip()
        assert stats, "no summary call ran"
        first = stats[0]
        instruction = real_engine.counter.count_prompt(  # type: ignore[attr-defined]
            [user(ModelSummarizer(engine=real_engine).context_instruction)]  # type: ignore[arg-type]
        )
        # Everything before the instruction came from the session's cache.
        assert first.cached_tokens > 0 and first.prefill_tokens <= instruction + 8
        assert first.cached_tokens + first.prefill_tokens == first.prompt_tokens
    finally:
        del real_engine.generate  # type: ignore[attr-defined]
        worker.close()
