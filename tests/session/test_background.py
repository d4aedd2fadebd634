"""Background work for a session: its summaries run on its own KV (``owner``), the
summary backlog is bounded and reports its lag, and once a summary is written the idle
session has the engine prefill its next prompt's prefix.

Fake engines and gated summarizers only (no sleeps decide an outcome, only bounds)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from convo import Budget, Session
from convo.errors import ConfigError
from convo.messages import Message
from convo.models.generation import Priority
from convo.store import MemoryStore
from convo.summarize import (
    BACKLOG_FULL,
    JobStatus,
    Summarizer,
    SummaryStatus,
    SummaryWorker,
)
from convo.testing import ScriptedEngine

WAIT = 10.0

ROOMY = Budget(
    context_tokens=8000, max_new_tokens=50, window_turns=2, summarize_batch_turns=1, summary_tokens=40
)


class RecordingEngine(ScriptedEngine):
    """Records every generate call's options, and (when ``supports_prefill``) every prefill."""

    def __init__(self, *, prefill: bool = False) -> None:
        super().__init__()
        self._prefill = prefill
        self.options: list[dict[str, Any]] = []
        self.prefills: list[tuple[tuple[Message, ...], str]] = []
        self.prefill_threads: list[threading.Thread] = []
        self.prefilled = threading.Event()

    @property
    def supports_prefill(self) -> bool:
        return self._prefill

    def generate(self, messages: Sequence[Message], *, max_new_tokens: int, **options: Any) -> Any:
        self.options.append(dict(options))
        return super().generate(messages, max_new_tokens=max_new_tokens, **options)

    def prefill(self, messages: Sequence[Message], *, cache_key: str) -> None:
        self.prefills.append((tuple(messages), cache_key))
        self.prefill_threads.append(threading.current_thread())
        self.prefilled.set()


class Gated(Summarizer):
    """An old-style summarizer (no ``owner=``): writes ``S(...)`` once ``gate`` is set."""

    def __init__(self, *, open_gate: bool = True) -> None:
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        assert self.gate.wait(WAIT), "test gate never opened"
        return "S(" + ";".join(m.content[:6] for m in messages) + ")"


@pytest.fixture
def worker() -> Any:
    w = SummaryWorker(threads=2, max_defer_s=0.0)
    yield w
    w.close(wait=False)


def pairs(messages: Sequence[Message]) -> list[tuple[str, str]]:
    return [(m.role.value, m.content) for m in messages]


# -- owner ----------------------------------------------------------------------------------------


def test_the_model_summary_runs_for_its_session_as_owner(worker: SummaryWorker) -> None:
    engine = RecordingEngine()
    session = Session(engine, budget=ROOMY, summaries=worker)  # the default ModelSummarizer
    session.send("turn 0")
    session.send("turn 1")  # turn 0 leaves the window: its summary is submitted
    job = worker.job(session.store, session.id)
    assert job is not None and job.wait(WAIT) and job.status is JobStatus.DONE
    background = [o for o in engine.options if o.get("priority") is Priority.BACKGROUND]
    replies = [o for o in engine.options if o.get("priority") is not Priority.BACKGROUND]
    assert background and all(o["owner"] == session.id for o in background)
    assert all(o["cache_key"] == session.id and o.get("owner") is None for o in replies)


def test_an_old_summarizer_without_owner_keeps_working(worker: SummaryWorker) -> None:
    session = Session(RecordingEngine(), budget=ROOMY, summarizer=Gated(), summaries=worker)
    session.send("turn 0")
    session.send("turn 1")
    assert session.wait_summary(WAIT).status is SummaryStatus.DONE
    assert session.summary == "S(turn 0;reply )"


def test_a_duck_typed_summarizer_that_does_not_declare_owner_is_refused_clearly() -> None:
    class Duck:
        supports_cancel = False

        def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
            return previous

    with pytest.raises(ConfigError, match="supports_owner"):
        Session(RecordingEngine(), budget=ROOMY, summarizer=Duck())  # type: ignore[arg-type]


# -- the backlog ----------------------------------------------------------------------------------


def _submit(worker: SummaryWorker, store: MemoryStore, sid: str, summ: Summarizer, **kw: Any) -> Any:
    return worker.submit(
        store=store,
        session_id=sid,
        summarizer=summ,
        previous="",
        messages=(),
        start=0,
        end=1,
        max_tokens=8,
        **kw,
    )


def test_the_backlog_is_bounded_sheds_beyond_it_and_never_sheds_an_urgent_job() -> None:
    worker = SummaryWorker(threads=1, max_defer_s=0.0, max_backlog=2)
    store, summ = MemoryStore(), Gated(open_gate=False)
    try:
        running = _submit(worker, store, "a", summ)
        deadline = threading.Event()
        for _ in range(200):  # the single thread takes the first job
            if running.status is JobStatus.RUNNING:
                break
            deadline.wait(0.01)
        assert running.status is JobStatus.RUNNING
        queued = [_submit(worker, store, sid, summ) for sid in ("b", "c")]
        shed = _submit(worker, store, "d", summ)
        assert all(j.status is JobStatus.QUEUED for j in queued)
        assert shed.status is JobStatus.CANCELLED and shed.error == BACKLOG_FULL
        urgent = _submit(worker, store, "e", summ, urgent=True)
        assert urgent.status is JobStatus.QUEUED
        stats = worker.stats()
        assert (stats.queued, stats.running, stats.backlog, stats.shed) == (3, 1, 4, 1)
        # Resubmitted later, the shed turns' lag counts from when they first became due.
        assert _submit(worker, store, "d", summ, urgent=True).due_at == shed.due_at
    finally:
        summ.gate.set()
        worker.close(wait=True, timeout_s=WAIT)


def test_summaries_drain_while_replies_run() -> None:
    worker = SummaryWorker(threads=1, max_defer_s=0.05)
    store = MemoryStore()
    try:
        with worker.replying():  # a reply streams the whole time
            jobs = [_submit(worker, store, f"s{i}", Gated()) for i in range(3)]
            # The sessions do not exist in the store: each job ends (cancelled) after running.
            assert all(j.wait(WAIT) for j in jobs)
            assert all(j.started_at is not None for j in jobs)
    finally:
        worker.close(wait=False)


def test_the_lag_is_reported_in_the_session_state(worker: SummaryWorker) -> None:
    summ = Gated(open_gate=False)
    session = Session(RecordingEngine(), budget=ROOMY, summarizer=summ, summaries=worker)
    session.send("turn 0")
    session.send("turn 1")
    waiting = session.summary_state
    assert waiting.status is not SummaryStatus.DONE and waiting.lag_s is None
    assert waiting.due_s >= 0.0 and waiting.backlog == 1
    summ.gate.set()
    done = session.wait_summary(WAIT)
    assert done.status is SummaryStatus.DONE and done.lag_s is not None and done.lag_s >= 0.0
    assert done.due_s == 0.0 and done.backlog == 0
    assert {"lag_s", "due_s", "backlog"} <= set(done.to_dict())
    stats = worker.stats()
    assert stats.written == 1 and stats.lag.count == 1


# -- the next prompt's prefix, prefilled when the summary is in ------------------------------------------


def test_an_idle_session_prefills_exactly_its_next_prompts_prefix(worker: SummaryWorker) -> None:
    engine = RecordingEngine(prefill=True)
    session = Session(engine, budget=ROOMY, system_prompt="Be brief.", summarizer=Gated(), summaries=worker)
    session.send("turn 0")
    session.send("turn 1")  # turn 0 leaves the window; its summary is written in the background
    assert engine.prefilled.wait(WAIT)
    prefix, key = engine.prefills[-1]
    assert key == session.id
    assert any("S(turn 0" in m.content for m in prefix)  # the new summary
    assert pairs(prefix)[0] == ("system", "Be brief.")
    session.send("turn 2")  # the turn after the slide
    sent = engine.prompts[-1]
    assert pairs(sent[: len(prefix)]) == pairs(prefix)
    assert pairs(sent[len(prefix) :]) == [("user", "turn 2")]


class MidTurn(RecordingEngine):
    """Runs ``during`` inside the next generate call (the turn holds the session then)."""

    def __init__(self) -> None:
        super().__init__(prefill=True)
        self.during: Any = None

    def generate(self, messages: Sequence[Message], *, max_new_tokens: int, **options: Any) -> Any:
        during, self.during = self.during, None
        if during is not None:
            during()
        return super().generate(messages, max_new_tokens=max_new_tokens, **options)


def _summary_lands_during_the_next_turn(worker: SummaryWorker) -> tuple[MidTurn, Gated, Session]:
    """Two turns (turn 0 leaves the window; its summary waits at the gate), then the summary
    is set to land while the next turn generates (the turn holds the session then)."""
    engine = MidTurn()
    summ = Gated(open_gate=False)
    session = Session(
        engine, budget=ROOMY, system_prompt="Be brief.", summarizer=summ, summaries=worker, summary_wait_s=0
    )
    session.send("turn 0")
    session.send("turn 1")
    job = worker.job(session.store, session.id)
    assert job is not None

    def land_the_summary() -> None:
        summ.gate.set()
        assert job.wait(WAIT) and job.status is JobStatus.DONE
        summ.gate.clear()  # (the next summary, of turn 1, waits until the end)
        assert engine.prefills == []  # (not mid-turn)

    engine.during = land_the_summary
    return engine, summ, session


def test_a_summary_written_during_a_turn_is_prefilled_once_the_turn_ends(worker: SummaryWorker) -> None:
    # The summary of turn 0 lands while turn 2 generates: the worker cannot prefill then
    # (the turn holds the session), so the turn does it on its way out.
    engine, summ, session = _summary_lands_during_the_next_turn(worker)
    session.send("turn 2")
    assert engine.prefilled.wait(WAIT)
    [(prefix, key)] = engine.prefills
    assert key == session.id
    assert pairs(prefix)[0] == ("system", "Be brief.")
    assert any("S(turn 0" in m.content for m in prefix)
    assert ("user", "turn 2") in pairs(prefix)  # the window after the turn, not before it
    summ.gate.set()
    later = worker.job(session.store, session.id)
    assert later is not None and later.wait(WAIT)


def test_after_an_async_turn_the_due_prefill_runs_off_the_event_loop(worker: SummaryWorker) -> None:
    # The same as above through asend: the prefill reads the store, so it must not run on
    # the loop's thread (a Redis round trip there would stall every other request).
    engine = MidTurn()
    summ = Gated(open_gate=False)
    session = Session(engine, budget=ROOMY, summarizer=summ, summaries=worker, summary_wait_s=0)

    async def chat() -> threading.Thread:
        await session.asend("turn 0")
        await session.asend("turn 1")
        job = worker.job(session.store, session.id)
        assert job is not None

        def land_the_summary() -> None:
            summ.gate.set()
            assert job.wait(WAIT)
            summ.gate.clear()

        engine.during = land_the_summary
        await session.asend("turn 2")
        return threading.current_thread()

    loop_thread = asyncio.run(chat())
    assert engine.prefilled.wait(WAIT)
    assert len(engine.prefills) == 1 and any("S(turn 0" in m.content for m in engine.prefills[0][0])
    assert engine.prefill_threads[0] is not loop_thread
    summ.gate.set()
    later = worker.job(session.store, session.id)
    assert later is not None and later.wait(WAIT)


def test_no_prefill_while_a_turn_holds_the_session(worker: SummaryWorker) -> None:
    engine = RecordingEngine(prefill=True)
    summ = Gated(open_gate=False)
    session = Session(engine, budget=ROOMY, summarizer=summ, summaries=worker)
    session.send("turn 0")
    session.send("turn 1")
    job = worker.job(session.store, session.id)
    assert job is not None
    with session.store.lock(session.id):  # another turn (here: this thread) holds the session
        summ.gate.set()
        assert job.wait(WAIT) and job.status is JobStatus.DONE
    assert engine.prefills == []


def test_an_engine_without_prefill_is_not_asked(worker: SummaryWorker) -> None:
    engine = RecordingEngine(prefill=False)
    session = Session(engine, budget=ROOMY, summarizer=Gated(), summaries=worker)
    session.send("turn 0")
    session.send("turn 1")
    job = worker.job(session.store, session.id)
    assert job is not None and job.wait(WAIT)
    assert session.prefill_next() is False and engine.prefills == []


def test_a_closed_session_is_not_prefilled(worker: SummaryWorker) -> None:
    engine = RecordingEngine(prefill=True)
    summ = Gated(open_gate=False)
    session = Session(engine, budget=ROOMY, summarizer=summ, summaries=worker)
    session.send("turn 0")
    session.send("turn 1")
    job = worker.job(session.store, session.id)
    assert job is not None
    session.close()  # (the job is cancelled; were it past its store write, it would still end)
    summ.gate.set()
    assert job.wait(WAIT)
    assert engine.prefills == [] and session.id in engine.released


def test_a_turn_inside_an_outer_holders_lock_prefills_once_that_lets_go(worker: SummaryWorker) -> None:
    # The server holds the session's store lock around the whole request: a summary written
    # during the turn is prefilled when that lets go (Store.after_release), not never.
    engine, summ, session = _summary_lands_during_the_next_turn(worker)
    with session.store.lock(session.id):
        session.send("turn 2")
        assert engine.prefills == []  # (the session is still held)
    [(prefix, key)] = engine.prefills
    assert key == session.id and any("S(turn 0" in m.content for m in prefix)
    summ.gate.set()
    later = worker.job(session.store, session.id)
    assert later is not None and later.wait(WAIT)


def test_work_left_for_after_a_lock_runs_when_the_outermost_hold_lets_go() -> None:
    from convo.stores import InMemoryStore

    store = InMemoryStore()
    ran: list[str] = []
    store.after_release("s", lambda: ran.append("free"))  # not held: at once
    assert ran == ["free"]
    with store.lock("s"):
        with store.lock("s"):
            store.after_release("s", lambda: ran.append("later"))
            store.after_release("s", lambda: 1 / 0)  # type: ignore[func-returns-value]  # logged only
        assert ran == ["free"]  # still held by the outer hold
    assert ran == ["free", "later"]
    with store.lock("s"):
        pass
    assert ran == ["free", "later"]  # once
