"""Summaries off the reply path: the reply returns and is stored before its summary runs;
the next turn waits for the summary only when its prompt needs it, within
``summary_wait_s``; failures are reported and retried; a crash or a cancel loses nothing.

Fast tests use fake engines and summarizers gated by events (no sleeps decide an outcome,
only bounds); one slow test runs the default model on CPU."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from conftest import FakeEngine

from convo import Budget, Session
from convo.errors import ConfigError
from convo.messages import Message, Role
from convo.session import DEFAULT_SUMMARY_WAIT_S
from convo.store import MemoryStore, SessionState, SQLiteStore
from convo.summarize import (
    PROVISIONAL_HEADER,
    JobStatus,
    Summarizer,
    SummaryJob,
    SummaryStatus,
    SummaryWorker,
    provisional_summary,
)
from convo.tokens import CharCounter

WAIT = 10.0  # seconds a test waits for something that happens at once; a hang fails, not blocks


class GatedSummarizer(Summarizer):
    """Writes ``S[start..]`` summaries, but only once ``gate`` is set; can fail on demand."""

    def __init__(self, *, open_gate: bool = False, fail_times: int = 0) -> None:
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.started = threading.Event()
        self.calls: list[int] = []
        self.fail_times = fail_times

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        self.started.set()
        assert self.gate.wait(WAIT), "test gate never opened"
        self.calls.append(len(messages))
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("summarizer down")
        return (previous + " | " + ";".join(m.content[:6] for m in messages)).strip(" |")


@pytest.fixture
def worker() -> Iterator[SummaryWorker]:
    w = SummaryWorker(threads=2, max_defer_s=0.0)
    yield w
    w.close(wait=False)


# ~210 tokens a turn under CharCounter: 3 turns fit in the 650 prompt tokens, 4 do not.
BIG = "w" * 800
TIGHT = Budget(
    context_tokens=700, max_new_tokens=50, window_turns=2, summarize_batch_turns=1, summary_tokens=40
)
ROOMY = Budget(
    context_tokens=8000, max_new_tokens=50, window_turns=2, summarize_batch_turns=1, summary_tokens=40
)


def job_of(session: Session, worker: SummaryWorker):  # type: ignore[no-untyped-def]
    job = worker.job(session.store, session.id)
    assert job is not None
    return job


def summary_under_way(
    engine: FakeEngine, worker: SummaryWorker, *, summary_wait_s: float
) -> tuple[GatedSummarizer, Session]:
    """A session (tight budget) whose next turn needs the summary of its first turns, which
    has started and holds until ``summ.gate`` is set."""
    summ = GatedSummarizer()
    session = Session(engine, budget=TIGHT, summarizer=summ, summaries=worker, summary_wait_s=summary_wait_s)
    for i in range(3):
        session.send(f"turn {i} {BIG}")
    assert summ.started.wait(WAIT)
    return summ, session


def test_reply_returns_and_is_stored_before_the_summary_runs(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    summ = GatedSummarizer()
    store = MemoryStore()
    session = Session(fake_engine, budget=ROOMY, store=store, summarizer=summ, summaries=worker)
    for i in range(2):
        reply = session.send(f"turn {i}")
    # After turn 2 the window slides (one turn ahead, for turn 3): turn 0 leaves. Its summary
    # is queued or running (blocked), and the reply is back.
    assert reply.stats.summary is not None
    assert reply.stats.summary.status in (SummaryStatus.PENDING, SummaryStatus.RUNNING)
    assert reply.stats.summarize_s == 0.0
    assert summ.started.wait(WAIT)
    state, messages = store.load(session.id)
    assert len(messages) == 4 and messages[-1].role is Role.ASSISTANT  # the turn is stored
    assert (state.evicted_turns, state.summarized_turns) == (1, 0)  # the window position too
    st = session.summary_state
    assert st.status is SummaryStatus.RUNNING and st.pending_turns == 1 and st.job_turns == (0, 1)
    summ.gate.set()
    assert job_of(session, worker).wait(WAIT)
    # The worker stored the summary itself, without another call on the session.
    state, _ = store.load(session.id)
    assert (state.summarized_turns, state.summary) == (1, "turn 0;reply")
    assert session.summary_state.status is SummaryStatus.DONE and session.summarized_turns == 1


def test_next_turn_does_not_wait_when_the_unsummarized_turns_fit(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    summ = GatedSummarizer()
    session = Session(fake_engine, budget=ROOMY, summarizer=summ, summaries=worker, summary_wait_s=None)
    for i in range(2):
        session.send(f"turn {i}")
    reply = session.send("turn 2")  # the summary is still blocked: nothing to wait for
    assert reply.stats.summarize_s == 0.0 and reply.stats.hidden_turns == 0
    # The prompt shows the turns the summary does not cover yet: no turn is dropped.
    shown = [m.content for m in fake_engine.prompts[-1]]
    assert shown[:2] == ["turn 0", "reply 1"] and reply.plan.parts["summary"] == 0
    summ.gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE


def test_next_turn_waits_for_a_needed_summary_and_uses_it(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    summ, session = summary_under_way(fake_engine, worker, summary_wait_s=WAIT)
    job = job_of(session, worker)

    def open_once_waited_for() -> None:  # the turn promotes the job when it starts to wait
        deadline = time.monotonic() + WAIT
        while not job.urgent and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        summ.gate.set()

    opener = threading.Thread(target=open_once_waited_for)
    opener.start()
    reply = session.send(f"turn 3 {BIG}")
    opener.join()
    assert 0.05 <= reply.stats.summarize_s < WAIT
    assert reply.stats.hidden_turns == 0 and reply.plan.parts["summary"] > 0
    # (After turn 0's summary, the turn may also wait for the follow-up job of turn 1.)
    assert reply.plan.first_shown_turn in (1, 2) and reply.stats.prompt_tokens + 50 <= 700
    assert reply.stats.latency_s >= reply.stats.summarize_s
    assert "turn 0;" in fake_engine.prompts[-1][0].content  # the summary message


def test_past_the_bound_the_turn_goes_on_within_the_budget(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    summ, session = summary_under_way(fake_engine, worker, summary_wait_s=0.2)
    t0 = time.monotonic()
    reply = session.send(f"turn 3 {BIG}")
    assert 0.15 <= reply.stats.summarize_s < 5.0 and time.monotonic() - t0 < 5.0
    # Turns 0-1 do not all fit beside the window: the window and the previous (empty)
    # summary, as if the summary were there; turns 0-1 are left out of this prompt, not lost.
    assert reply.stats.hidden_turns == 2 and reply.plan.first_shown_turn == 2
    assert reply.stats.prompt_tokens + 50 <= 700
    assert reply.stats.summary is not None and reply.stats.summary.status is SummaryStatus.RUNNING
    summ.gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    nxt = session.send("turn 4")
    assert nxt.stats.hidden_turns == 0 and nxt.plan.parts["summary"] > 0
    assert len(session.messages) == 10  # every message stored


def test_zero_wait_never_waits(fake_engine: FakeEngine, worker: SummaryWorker) -> None:
    summ = GatedSummarizer()
    session = Session(fake_engine, budget=TIGHT, summarizer=summ, summaries=worker, summary_wait_s=0)
    for i in range(4):
        reply = session.send(f"turn {i} {BIG}")
    assert reply.stats.summarize_s == 0.0 and reply.stats.hidden_turns == 2
    summ.gate.set()


def test_auto_wait_goes_on_at_once_beside_a_batching_engine(worker: SummaryWorker) -> None:
    """``summary_wait_s="auto"`` (the default) waits on an engine that runs one call at a
    time, and not on one that runs calls together: the turn shows a provisional summary
    (excerpts of the turns the summary misses) in its place, then the model's summary once
    the job is in."""
    assert Session(FakeEngine(), budget=TIGHT, summaries=worker).summary_wait_limit == DEFAULT_SUMMARY_WAIT_S
    engine = FakeEngine()
    engine.concurrent_calls = 4  # type: ignore[attr-defined]  # as a batching engine says
    summ = GatedSummarizer()
    session = Session(engine, budget=TIGHT, summarizer=summ, summaries=worker)
    assert session.summary_wait_limit == 0.0
    for i in range(3):
        session.send(f"turn {i} {BIG}")
    assert summ.started.wait(WAIT)
    replies = [session.send(f"turn {i} {BIG}") for i in (3, 4)]
    for reply in replies:
        assert reply.stats.summarize_s == 0.0 and reply.stats.provisional_summary
        assert reply.stats.hidden_turns >= 2 and reply.stats.prompt_tokens + 50 <= 700
        assert 0 < reply.plan.parts["summary"] <= TIGHT.summary_tokens + 8
    first = engine.prompts[-2][0].content
    assert PROVISIONAL_HEADER in first and "assistant: reply" in first
    summ.gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    nxt = session.send("turn 5")
    assert not nxt.stats.provisional_summary and "turn 0;" in engine.prompts[-1][0].content
    assert len(session.messages) == 12  # every message stored


def test_a_provisional_summary_stays_until_the_window_moves(worker: SummaryWorker) -> None:
    """When the model's summary lands while the prompt shows a provisional one, the next
    prompts from the same window start keep the provisional text (they extend the previous
    prompt, whose KV the engine reuses); the summary changes with the window's next move:
    one re-prefill per move, not two."""
    engine = FakeEngine(CharCounter())
    engine.concurrent_calls = 16  # type: ignore[attr-defined]
    engine.reply_fn = lambda _: "r" * 128
    summ = GatedSummarizer()
    budget = Budget(context_tokens=2048, max_new_tokens=32)
    session = Session(engine, budget=budget, summarizer=summ, summaries=worker)
    replies = [session.send("u0 " + "x" * 1196)]
    while not replies[-1].stats.provisional_summary and len(replies) < 12:
        replies.append(session.send(f"u{len(replies)} " + "x" * 1196))
    slid = replies[-1]  # the first turn after the window slid: its summary is not in yet
    assert slid.stats.provisional_summary and slid.plan.first_shown_turn > 0
    summ.gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    kept = session.send(f"u{len(replies)} " + "x" * 1196)
    assert kept.plan.first_shown_turn == slid.plan.first_shown_turn  # the window did not move
    assert kept.stats.provisional_summary and engine.prompts[-1][0] == engine.prompts[-2][0]
    moved = kept
    while moved.plan.first_shown_turn == kept.plan.first_shown_turn and len(replies) < 16:
        replies.append(moved := session.send(f"u{len(replies) + 1} " + "x" * 1196))
        if moved.plan.first_shown_turn == kept.plan.first_shown_turn:
            assert moved.stats.provisional_summary  # the window did not move: the text stays
    assert moved.plan.first_shown_turn > kept.plan.first_shown_turn
    assert engine.prompts[-1][0].content.startswith("Summary of the earlier conversation:\nu0 xxx")
    assert moved.stats.summarize_s == 0.0


def test_provisional_summary_fits_and_keeps_the_latest() -> None:
    counter = CharCounter()
    msgs = [Message(role=Role.USER, content=f"fact {i} " + "x" * 400) for i in range(6)]
    text = provisional_summary(
        previous="Earlier: Ana likes tea.", messages=msgs, counter=counter, max_tokens=120
    )
    assert counter.count_text(text) <= 120
    assert text.startswith("Earlier: Ana likes tea.") and PROVISIONAL_HEADER in text
    assert "fact 5" in text and "fact 0" not in text  # room for the latest messages only
    assert text == provisional_summary(
        previous="Earlier: Ana likes tea.", messages=msgs, counter=counter, max_tokens=120
    )
    roomy = provisional_summary(previous="", messages=msgs[:2], counter=counter, max_tokens=400)
    assert "fact 0" in roomy and "fact 1" in roomy and counter.count_text(roomy) <= 400
    long_previous = provisional_summary(
        previous="p" * 2000, messages=msgs[:1], counter=counter, max_tokens=100
    )
    assert "fact 0" in long_previous and counter.count_text(long_previous) <= 100  # half for the previous
    assert provisional_summary(previous="abc", messages=[], counter=counter, max_tokens=10) == "abc"


def test_failures_are_reported_and_retried(fake_engine: FakeEngine, worker: SummaryWorker) -> None:
    summ = GatedSummarizer(open_gate=True, fail_times=1)
    session = Session(fake_engine, budget=ROOMY, summarizer=summ, summaries=worker)
    for i in range(2):
        session.send(f"turn {i}")
    assert job_of(session, worker).wait(WAIT)
    st = session.summary_state
    assert st.status is SummaryStatus.FAILED and st.failures == 1 and "summarizer down" in st.error
    assert st.to_dict()["status"] == "failed"
    session.send("turn 2")  # the next turn retries
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    assert summ.calls == [2, 2, 2] and session.summarized_turns == 2


def test_a_failing_summarizer_never_blocks_turns(fake_engine: FakeEngine, worker: SummaryWorker) -> None:
    summ = GatedSummarizer(open_gate=True, fail_times=10**6)
    session = Session(fake_engine, budget=TIGHT, summarizer=summ, summaries=worker, summary_wait_s=1.0)
    for i in range(8):
        reply = session.send(f"turn {i} {BIG}")
        assert reply.stats.prompt_tokens + 50 <= 700
    state = session.wait_summary(WAIT)
    assert state.status is SummaryStatus.FAILED and state.failures >= 2
    assert len(session.messages) == 16 and session.summarized_turns == 0


def test_close_cancels_a_queued_summary_and_a_new_session_redoes_it(fake_engine: FakeEngine) -> None:
    worker = SummaryWorker(threads=1, max_defer_s=0.0)
    store = MemoryStore()
    try:
        blocker = GatedSummarizer()
        other = Session(fake_engine, budget=ROOMY, store=store, summarizer=blocker, summaries=worker)
        for i in range(2):
            other.send(f"other {i}")
        assert blocker.started.wait(WAIT)  # the only worker thread is busy
        summ = GatedSummarizer(open_gate=True)
        session = Session(fake_engine, budget=ROOMY, store=store, summarizer=summ, summaries=worker)
        for i in range(2):
            session.send(f"turn {i}")
        job = job_of(session, worker)
        assert job.status is JobStatus.QUEUED
        session.close()
        blocker.gate.set()
        assert job.wait(WAIT) and job.status is JobStatus.CANCELLED and summ.calls == []
        assert worker.job(store, session.id) is None  # a closed session leaves nothing behind
        assert session.summary_state.status is SummaryStatus.PENDING
        again = Session(fake_engine, store=store, session_id=session.id, summarizer=summ, summaries=worker)
        assert again.summary_state.pending_turns == 1
        assert again.wait_summary(WAIT).status is SummaryStatus.DONE and summ.calls == [2]
    finally:
        worker.close(wait=False)


def test_a_crash_between_reply_and_summary_loses_nothing(fake_engine: FakeEngine, tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    old_worker, new_worker = SummaryWorker(max_defer_s=0.0), SummaryWorker(max_defer_s=0.0)
    try:
        lost = GatedSummarizer()
        session = Session(
            fake_engine, budget=ROOMY, store=SQLiteStore(path), summarizer=lost, summaries=old_worker
        )
        for i in range(2):
            session.send(f"turn {i}")
        assert lost.started.wait(WAIT)
        # "Crash": the process is gone before the summary was written. A new process resumes.
        summ = GatedSummarizer(open_gate=True)
        resumed = Session(
            fake_engine, store=SQLiteStore(path), session_id=session.id, summarizer=summ, summaries=new_worker
        )
        assert len(resumed.messages) == 4
        st = resumed.summary_state
        assert st.status is SummaryStatus.PENDING and (st.summarized_turns, st.evicted_turns) == (0, 1)
        resumed.send("turn 2")  # re-derives the summary from the stored turns
        assert resumed.wait_summary(WAIT).status is SummaryStatus.DONE
        expected = resumed.summary
        assert expected.startswith("turn 0;")
        # The old job ends late: its compare-and-set sees a newer summary and drops itself.
        lost.gate.set()
        old = old_worker.job(session.store, session.id)
        assert old is not None and old.wait(WAIT) and old.status is JobStatus.CANCELLED
        state, messages = SQLiteStore(path).load(session.id)
        assert state.summary == expected and len(messages) == 6
    finally:
        old_worker.close(wait=False)
        new_worker.close(wait=False)


def test_summaries_defer_to_replies_in_flight_but_never_starve() -> None:
    store = MemoryStore()
    summ = GatedSummarizer(open_gate=True)

    def submit(worker: SummaryWorker, session_id: str) -> SummaryJob:
        """A one-turn summary job for a new session ``session_id``."""
        store.create(SessionState(session_id=session_id, evicted_turns=1))
        msgs = [Message(role=Role.USER, content="hello")]
        return worker.submit(
            store=store,
            session_id=session_id,
            summarizer=summ,
            previous="",
            messages=msgs,
            start=0,
            end=1,
            max_tokens=9,
        )

    worker = SummaryWorker(threads=1, max_defer_s=60.0)
    try:
        with worker.replying():
            job = submit(worker, "s")
            assert not job.wait(0.3) and job.status is JobStatus.QUEUED  # a reply is generating
        assert job.wait(WAIT) and job.status is JobStatus.DONE  # the reply ended: it runs
        with worker.replying():
            job = submit(worker, "t")
            assert not job.wait(0.2)
            worker.promote(job)  # a turn waits for it: it goes now
            assert job.wait(WAIT) and job.status is JobStatus.DONE
    finally:
        worker.close(wait=False)
    short = SummaryWorker(threads=1, max_defer_s=0.1)
    try:
        with short.replying():  # replies never end: the summary starts after max_defer_s
            job = submit(short, "u")
            assert job.wait(WAIT) and job.status is JobStatus.DONE
    finally:
        short.close(wait=False)


def test_the_stream_ends_before_the_summary(fake_engine: FakeEngine, worker: SummaryWorker) -> None:
    summ = GatedSummarizer()
    session = Session(fake_engine, budget=ROOMY, summarizer=summ, summaries=worker)
    session.send("turn 0")
    stream = session.stream("turn 1")
    text = "".join(stream)
    assert text.strip() == "reply 2" and stream.result is not None
    assert summ.started.wait(WAIT) and not summ.calls  # still running after the stream ended
    assert session.summary_state.status is SummaryStatus.RUNNING
    summ.gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE


def test_budget_holds_and_nothing_is_lost_while_summaries_lag(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    summ = GatedSummarizer()
    budget = Budget(
        context_tokens=600, max_new_tokens=40, window_turns=3, summarize_batch_turns=2, summary_tokens=60
    )
    session = Session(fake_engine, budget=budget, summarizer=summ, summaries=worker, summary_wait_s=0)
    for i in range(30):
        reply = session.send(f"turn {i} " + "v" * (37 * (i % 7)))
        assert reply.stats.prompt_tokens + 40 <= 600
        # Every turn is in the (stale) summary, shown, or counted as hidden.
        assert reply.plan.first_shown_turn == session.summarized_turns + reply.stats.hidden_turns
    summ.gate.set()
    state = session.wait_summary(WAIT)
    assert state.status is SummaryStatus.DONE and state.summarized_turns == session.evicted_turns > 20
    assert len(session.messages) == 60


def test_summary_wait_is_validated(fake_engine: FakeEngine) -> None:
    from convo.errors import ConfigError

    with pytest.raises(ConfigError):
        Session(fake_engine, summary_wait_s=-1)
    with pytest.raises(ConfigError):
        SummaryWorker(threads=0)


def test_remote_engine_summaries_run_after_the_reply(worker: SummaryWorker) -> None:
    from convo.engines.openai import OpenAIEngine

    gate = threading.Event()
    summary_requests: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.read())
        text = "the reply"
        instruction = body["messages"][-1]["content"]  # the template's, or the one after the prompt
        if instruction.startswith(("Earlier summary:", "Summarize the conversation above")):
            summary_requests.append(body)
            assert gate.wait(WAIT)
            text = "remote summary"
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        if body["stream"]:  # the summarizer streams, so that a cancel can close it
            events = [
                {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": usage},
            ]
            raw = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, content=raw.encode(), headers={"content-type": "text/event-stream"})
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return httpx.Response(
            200, json={"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    engine = OpenAIEngine(
        "http://engine.test/v1", "m", context_window=4096, transport=httpx.MockTransport(handler)
    )
    budget = engine.budget(max_new_tokens=32, window_turns=1, summarize_batch_turns=1, summary_tokens=40)
    session = Session(engine, budget=budget, summaries=worker)
    reply = session.send("My boat is called Nautilus.")
    assert reply.text == "the reply"
    deadline = time.monotonic() + WAIT
    while not summary_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert summary_requests and session.summary_state.status is SummaryStatus.RUNNING
    gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    assert session.summary == "remote summary"


@pytest.mark.slow
def test_real_model_reply_returns_before_its_summary_and_the_next_turn_uses_it(real_engine: object) -> None:
    """The default model on CPU: the turn on which the window slides returns with its
    summary still to write; the next turn, whose prompt needs it, waits and shows it."""
    worker = SummaryWorker(max_defer_s=0.0)
    filler = "We talked about the garden, the shed, the long fence and the neighbours again. " * 16
    budget = Budget(
        context_tokens=512, max_new_tokens=16, window_turns=1, summarize_batch_turns=1, summary_tokens=32
    )
    try:
        session = Session(real_engine, budget=budget, summaries=worker, summary_wait_s=None)  # type: ignore[arg-type]
        first = session.send("My boat is called Nautilus. " + filler)
        assert first.stats.summary is not None
        assert first.stats.summary.status in (SummaryStatus.PENDING, SummaryStatus.RUNNING)
        assert (
            first.stats.summary.pending_turns == 1 and session.store.load(session.id)[0].summarized_turns == 0
        )
        second = session.send("I also keep bees. " + filler)
        # Both turns do not fit: the turn waited for the summary of turn 0 and used it.
        assert second.stats.summarize_s > 0 and second.stats.hidden_turns == 0
        assert second.plan.parts["summary"] > 0 and second.plan.first_shown_turn == 1
        assert second.stats.prompt_tokens + 16 <= 512
        assert session.summarized_turns >= 1 and session.summary.strip()
    finally:
        worker.close()


def test_jobs_that_fall_behind_take_whole_batches_together(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    summ = GatedSummarizer()
    budget = Budget(window_turns=2, summary_tokens=30, summarize_batch_turns=3)
    session = Session(fake_engine, budget=budget, summarizer=summ, summaries=worker, summary_wait_s=0)
    for i in range(11):
        session.send(f"fact number {i}")
    summ.gate.set()
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    # Never one turn at a time: each call folds whole batches of 3 turns (6 messages).
    assert session.summarized_turns == 9 and sum(summ.calls) == 18
    assert all(n % 6 == 0 for n in summ.calls) and len(summ.calls) < 3


def test_summary_calls_are_background_priority_for_the_scheduler(worker: SummaryWorker) -> None:
    from convo.models import Generation, Priority

    seen: list[tuple[int, bool]] = []

    class Recording(FakeEngine):
        def generate(self, messages: Sequence[Message], **kw: object) -> Generation:  # type: ignore[override]
            # The priority the call asks of the engine (the local engine's scheduler reads it).
            seen.append((kw.get("priority") or Priority.REPLY, kw.get("cancel") is not None))  # type: ignore[arg-type]
            return super().generate(messages, **kw)  # type: ignore[arg-type]

    session = Session(Recording(), budget=ROOMY, summaries=worker)  # the default ModelSummarizer
    for i in range(2):
        session.send(f"turn {i}")
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    # Replies are served first; the summary call is background work that can be cancelled.
    assert seen[0] == (Priority.REPLY, False) and (Priority.BACKGROUND, True) in seen


def test_asend_waits_for_the_summary_without_blocking_the_event_loop(
    fake_engine: FakeEngine, worker: SummaryWorker
) -> None:
    import asyncio

    summ, session = summary_under_way(fake_engine, worker, summary_wait_s=WAIT)
    job = job_of(session, worker)

    async def main() -> tuple[float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
                if job.urgent and ticks > 20:  # the turn waits, and the loop kept running
                    summ.gate.set()

        tick = asyncio.create_task(ticker())
        reply = await session.asend(f"turn 3 {BIG}")
        tick.cancel()
        return reply.stats.summarize_s, reply.plan.parts["summary"]

    waited, summary_tokens = asyncio.run(main())
    assert waited > 0 and summary_tokens > 0


def test_a_server_sizes_the_shared_worker_to_its_engine_batch() -> None:
    """The process-wide worker runs as many summaries at once as the engine batches
    (its KV slots); asking for fewer never shrinks it."""
    from convo.summarize import SummaryWorker

    worker = SummaryWorker.shared()
    before = worker.threads
    assert SummaryWorker.shared(min_threads=before + 5) is worker and worker.threads == before + 5
    assert SummaryWorker.shared(min_threads=1).threads == before + 5
    defer = worker.max_defer_s
    assert SummaryWorker.shared(max_defer_s=0.0).max_defer_s == 0.0
    worker.threads, worker.max_defer_s = before, defer


class SummaryCallsEngine(FakeEngine):
    """A fake engine with a small context that records each call's prompt and reply cap."""

    def __init__(self, context_window: int) -> None:
        super().__init__(context_window=context_window)
        self.calls: list[tuple[int, int]] = []  # (prompt tokens, max_new_tokens)

    def generate(self, messages: Sequence[Message], *, max_new_tokens: int, **options: object):  # type: ignore[no-untyped-def]
        self.calls.append((self.counter.count_prompt(messages), max_new_tokens))
        return super().generate(messages, max_new_tokens=max_new_tokens, **options)  # type: ignore[arg-type]


def test_the_summary_cap_follows_a_512_token_context(worker: SummaryWorker) -> None:
    """Defect 19: with a 512-token model context (KV slots of a 512-token budget) the
    default 256-token summary cap left a summary call no room, and every summary failed,
    turn after turn. The cap now follows the context: every summary is written, and each
    summary call (prompt + summary) fits the 512 tokens."""
    from convo.session import SummaryConfig

    engine = SummaryCallsEngine(context_window=512)
    budget = Budget(context_tokens=512, max_new_tokens=64, window_turns=1, summarize_batch_turns=1)
    session = Session(engine, budget=budget, summarizing=SummaryConfig(worker=worker, wait_s=None))
    assert 32 <= session.summary_cap < budget.summary_tokens == 256
    for i in range(4):
        session.send(f"fact {i}: " + "the shed by the long fence " * 8)
    state = session.wait_summary(WAIT)
    assert state.status is SummaryStatus.DONE and state.failures == 0 and session.summarized_turns == 4
    assert len(engine.calls) > 4  # the 4 replies and the summaries
    assert all(prompt + cap <= 512 for prompt, cap in engine.calls)
    assert {cap for _, cap in engine.calls} == {64, session.summary_cap}  # replies, summaries
    assert session.counter.count_text(session.summary) <= session.summary_cap


def test_a_lowered_summary_cap_is_logged_once_not_at_every_session(
    worker: SummaryWorker, caplog: pytest.LogCaptureFixture
) -> None:
    """A server opens a Session per request: the cap's note was logged at every one."""
    import logging

    from convo.session import SummaryConfig

    engine = SummaryCallsEngine(context_window=509)  # a context no other test uses: a fresh note
    budget = Budget(context_tokens=509, max_new_tokens=64, window_turns=1)
    with caplog.at_level(logging.INFO, logger="convo.session"):
        for _ in range(3):
            Session(engine, budget=budget, summarizing=SummaryConfig(worker=worker))
    notes = [r for r in caplog.records if "summaries capped at" in r.getMessage()]
    assert len(notes) == 1 and "509-token context" in notes[0].getMessage()


def test_a_context_too_small_for_any_summary_is_refused_at_construction() -> None:
    store = MemoryStore()
    engine = FakeEngine(context_window=120)
    with pytest.raises(
        ConfigError, match=r"summary_tokens=256.*Budget\(summary_tokens=0\).*at least \d+ tokens"
    ):
        Session(engine, budget=Budget(context_tokens=120, max_new_tokens=32), store=store)
    assert store.list_sessions() == []  # nothing stored for the refused session
    session = Session(engine, budget=Budget(context_tokens=120, max_new_tokens=32, summary_tokens=0))
    assert session.summary_cap == 0 and session.send("hi").text


@pytest.mark.slow
def test_real_model_summarizes_within_a_512_token_context(real_engine: object) -> None:
    """The default model, its summary calls held to 512 tokens: the default 256-token cap
    follows that context, and the summary is written (it failed on every turn before)."""
    from convo.session import SummaryConfig
    from convo.summarize import ModelSummarizer

    worker = SummaryWorker(max_defer_s=0.0)
    summarizer = ModelSummarizer(engine=real_engine, max_input_tokens=512, timeout_s=300)  # type: ignore[arg-type]
    budget = Budget(context_tokens=512, max_new_tokens=16, window_turns=1, summarize_batch_turns=1)
    try:
        session = Session(
            real_engine,  # type: ignore[arg-type]
            budget=budget,
            summarizing=SummaryConfig(summarizer=summarizer, worker=worker, wait_s=0),
        )
        assert session.summary_cap < 256
        session.send("My boat is called Nautilus and it is moored in Brest.")
        session.send("I also keep bees.")
        state = session.wait_summary(300)
        assert state.status is SummaryStatus.DONE and state.failures == 0
        assert session.summary.strip()
        assert session.counter.count_text(session.summary) <= session.summary_cap
    finally:
        worker.close()


def test_a_summarizer_that_declares_nothing_is_refused_at_the_edge(fake_engine: FakeEngine) -> None:
    class Bare:  # no supports_cancel: it would fail only later, in the worker thread
        def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
            return previous

    with pytest.raises(ConfigError, match=r"convo\.summarize\.Summarizer"):
        Session(fake_engine, budget=ROOMY, summarizer=Bare())  # type: ignore[arg-type]
