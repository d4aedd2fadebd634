"""A session's side of its rolling summary: which turns it owes, the job that folds them
(run by the shared :class:`~convo.summarize.SummaryWorker`), the provisional summary a
prompt shows while that job is late, and how long a turn waits for it.

::

    turn n:   plan ── generate ── store reply, slide window ── return ─┐
                                                                       └─ summary job (background)
    turn n+1: [wait for the job only if the turns it folds do not fit beside the window,
               at most summary_wait_s] ── plan ── generate ── ...

The stored turns are the source of truth: a job lost to a crash, a failure or a cancel is
submitted again from them on the next turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Final

from convo.engines.base import Engine, concurrent_calls
from convo.errors import ConfigError
from convo.messages import Message
from convo.plan import SUMMARY_HEADER, PromptPlan, summary_message
from convo.session.history import History
from convo.session.turn import SummaryWait
from convo.stores import SessionState, Store
from convo.summarize import (
    BACKLOG_FULL,
    JobStatus,
    Summarizer,
    SummaryJob,
    SummaryState,
    SummaryStatus,
    SummaryWorker,
    provisional_summary,
)
from convo.tokens import TokenCounter

logger = logging.getLogger(__package__)

#: Seconds a turn waits for its session's background summary, when the turns it folds do
#: not fit beside the window, on an engine that runs one call at a time (``summary_wait_s``
#: ``"auto"``, the default): the reply would queue behind the summary's model call anyway.
#: A summary takes 5-60 s with the default model on a small shared CPU.
DEFAULT_SUMMARY_WAIT_S = 30.0
#: ``Session(summary_wait_s="auto")``: :data:`DEFAULT_SUMMARY_WAIT_S` on an engine that runs
#: one call at a time, 0 on one that runs calls together
#: (:func:`~convo.engines.base.concurrent_calls` > 1: a batching local engine, a server).
SUMMARY_WAIT_AUTO: Final = "auto"


def prompt_context(
    prompt: Sequence[Message], folded: Sequence[Message], previous: str
) -> tuple[Message, ...]:
    """The start of ``prompt`` (a turn's prompt and its reply) up to and including the
    ``folded`` messages, when the prompt shows them whole and together right after its
    pinned part and the summary ``previous`` (no summary message when ``previous`` is
    empty): what a summary of them written as the prompt's continuation reads
    (:class:`~convo.summarize.ModelSummarizer`). ``()`` when the prompt does not show them
    so (a turn cut to fit, a provisional summary, passages between them)."""
    n = len(folded)
    if not n:
        return ()
    for i in range(len(prompt) - n + 1):
        if tuple(prompt[i : i + n]) == tuple(folded):
            head = prompt[:i]
            summaries = [m for m in head if m.content.startswith(SUMMARY_HEADER)]
            wanted = [summary_message(previous)] if previous else []
            if summaries != wanted or (previous and head[-1] != wanted[0]):
                return ()
            return tuple(prompt[: i + n])
    return ()


def check_summary_wait(value: object) -> None:
    """Raise :class:`~convo.errors.ConfigError` unless ``value`` is a valid
    ``summary_wait_s``: seconds >= 0, ``"auto"`` or ``None``."""
    if value is None or value == SUMMARY_WAIT_AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"summary_wait_s must be seconds >= 0, 'auto' or None, got {value!r}")


def summary_wait_limit(wait_s: float | str | None, engine: Engine | None) -> float | None:
    """Seconds a turn waits for a late summary: ``wait_s``, with ``"auto"`` resolved for
    ``engine``; ``None``: no limit."""
    if wait_s != SUMMARY_WAIT_AUTO:
        return wait_s  # type: ignore[return-value]
    return 0.0 if concurrent_calls(engine) > 1 else DEFAULT_SUMMARY_WAIT_S


@dataclass(frozen=True)
class Planned:
    """The summary a turn's prompt was planned with."""

    summary: str  # the stored summary, or the provisional one the prompt showed
    summarized_turns: int
    summarizing: bool  # False: turns that leave the window are meant to go (no summary)
    start: int  # the first turn the planner could show
    provisional: bool = False

    def hidden_turns(self, plan: PromptPlan) -> int:
        """Turns neither in that summary nor in the prompt."""
        return max(plan.first_shown_turn - self.summarized_turns, 0) if self.summarizing else 0


class SessionSummary:
    """One session's rolling summary, coordinated with the background worker.

    The session's :class:`~convo.stores.SessionState` stays the session's: methods take
    the state and return the new one.

    Args:
        worker: runs the summary jobs (shared by sessions).
        store / session_id: the session whose turns are folded.
        counter: counts the provisional summary.
        summarizer: folds turns; ``None`` (and ``max_tokens`` 0): turns that leave the
            window are not summarized. Set once the session knows its budget.
        max_tokens: the summary's cap, in tokens.
        on_written: called (in the worker thread) once a job of this session has stored
            its summary; the session prefills its next prompt's prefix there.

    Jobs carry the session id as ``owner`` (the ``cache_key`` of the session's turns), so
    the summary runs on the session's own KV.

    Attributes:
        epoch: the epoch of the session these summaries are of
            (:attr:`~convo.stores.SessionState.epoch`), set by the session when it creates,
            resumes or re-reads it. Jobs carry it: a job of another epoch (the session was
            deleted and its id reused) is not this session's, and its result is never
            picked up here nor stored by the store.
    """

    def __init__(
        self,
        *,
        worker: SummaryWorker,
        store: Store,
        session_id: str,
        counter: TokenCounter,
        summarizer: Summarizer | None = None,
        max_tokens: int = 0,
        on_written: Callable[[SummaryJob], None] | None = None,
    ) -> None:
        self.on_written = on_written
        self.worker = worker
        self.store = store
        self.session_id = session_id
        self.counter = counter
        self.summarizer = summarizer
        self.max_tokens = max_tokens
        self.epoch: str | None = None
        #: (start, text, covered turns) of the provisional summary the last prompt showed.
        #: Kept by this object only: the server builds one per request, so its next turn
        #: shows the model's summary once it lands, and the summary of the next slide then
        #: continues that prompt's KV. Kept for every object of the process (tried on
        #: 2026-12-07, think-16 on the H200), the next slide's summaries found the
        #: provisional text where their previous summary should be, and prefilled 29.6k
        #: prompt tokens instead of 2.1k: re-prefill 0.41 against 0.35, TTFT p95 0.84 s
        #: against 0.56-0.62 s, for the one re-prefill per slide it saved.
        self._provisional: tuple[int, str, int] | None = None

    def renewed(self, epoch: str) -> SessionSummary:
        """The same settings for the session of ``epoch`` (nothing of this one's
        provisional summary kept)."""
        fresh = SessionSummary(
            worker=self.worker,
            store=self.store,
            session_id=self.session_id,
            counter=self.counter,
            summarizer=self.summarizer,
            max_tokens=self.max_tokens,
            on_written=self.on_written,
        )
        fresh.epoch = epoch
        return fresh

    @property
    def active(self) -> bool:
        """Whether turns that leave the window are folded into the summary."""
        return self.summarizer is not None and self.max_tokens > 0

    def key_lock(self) -> threading.Lock:
        """Held while the session's state is written (a finished job writes it too)."""
        return self.worker.key_lock(self.store, self.session_id)

    def job(self) -> SummaryJob | None:
        """The session's last job (any status), if it is of this session's epoch."""
        job = self.worker.job(self.store, self.session_id)
        return job if job is not None and job.epoch == self.epoch else None

    def live_job(self) -> SummaryJob | None:
        """The session's queued or running job."""
        job = self.job()
        return job if job is not None and job.live else None

    def owes(self, state: SessionState) -> bool:
        """Whether turns left the window that the summary does not cover yet."""
        return self.active and state.evicted_turns > state.summarized_turns

    def first_candidate_turn(self, state: SessionState) -> int:
        """The oldest turn the planner may show: the window's first, or the first turn the
        summary does not cover yet when the summary is behind (a turn is never dropped
        from both)."""
        if self.active:
            return min(state.evicted_turns, state.summarized_turns)
        return state.evicted_turns

    def picked_up(self, state: SessionState, *, locked: bool = False) -> SessionState:
        """``state`` with a background summary that finished (the worker has already
        stored it). ``locked``: the caller holds :meth:`key_lock`."""
        job = self.job()
        if job is None or job.status is not JobStatus.DONE or job.start != state.summarized_turns:
            return state
        if not locked:
            with self.key_lock():
                return self.picked_up(state, locked=True)
        if job.end > state.summarized_turns:
            return replace(state, summary=job.result, summarized_turns=job.end)
        return state

    def submit(
        self, state: SessionState, history: History, *, urgent: bool = False, prompt: Sequence[Message] = ()
    ) -> SummaryJob | None:
        """Queue a background job for every turn that left the window and is not
        summarized (or return the live one: the next job folds into its result).
        ``urgent``: a turn waits for it (never shed by a full backlog). ``prompt``: the
        turn just answered, its prompt's messages and the reply: where it shows the turns
        to fold after the summary, the job carries that start of it (:func:`prompt_context`),
        so the summary reuses the session's cached KV."""
        if not self.owes(state):
            return None
        assert self.summarizer is not None
        start, end = state.summarized_turns, state.evicted_turns
        messages = history.messages_of(start, end)
        return self.worker.submit(
            store=self.store,
            session_id=self.session_id,
            summarizer=self.summarizer,
            previous=state.summary,
            messages=messages,
            context=prompt_context(prompt, messages, state.summary) if prompt else (),
            start=start,
            end=end,
            max_tokens=self.max_tokens,
            epoch=self.epoch,
            owner=self.session_id,  # the cache_key of the session's turns
            urgent=urgent,
            on_written=self.on_written,
        )

    def maybe_submit(
        self,
        state: SessionState,
        history: History,
        *,
        batch_turns: int,
        window_moved: bool = False,
        prompt: Sequence[Message] = (),
    ) -> None:
        """Fold evicted turns into the summary once ``batch_turns`` are waiting, or
        whenever the window has just moved (the prompt's start changes anyway, so changing
        the summary on the same turn costs no extra re-prefill). ``prompt``: see
        :meth:`submit`."""
        pending = state.evicted_turns - state.summarized_turns
        if not self.active or pending <= 0:
            return
        if pending < batch_turns and not window_moved:
            return
        self.submit(state, history, prompt=prompt)

    def text(self, start: int, state: SessionState, history: History) -> tuple[str, bool, int]:
        """The summary a prompt that starts at turn ``start`` shows, whether it is
        provisional, and the turns its model-written part covers: the stored summary, or,
        when that misses turns before ``start``, the provisional summary that adds
        excerpts of them. A provisional summary stays until the window moves, even when
        the model's lands meanwhile: the prompt keeps extending the previous one (its KV
        is reused), and the summary changes with the window, one re-prefill per move."""
        done = state.summarized_turns
        if self._provisional is not None and self._provisional[0] == start:
            return self._provisional[1], True, self._provisional[2]
        if not self.active or start <= done:
            return state.summary, False, done
        text = provisional_summary(
            previous=state.summary,
            messages=history.messages_of(done, start),
            counter=self.counter,
            max_tokens=self.max_tokens,
        )
        return text, True, done

    def planned(self, start: int, state: SessionState, history: History) -> Planned:
        """What a turn's prompt, planned from ``start``, showed as its summary; a
        provisional one is kept for the next prompts from the same start."""
        summary, provisional, covered = self.text(start, state, history)
        self._provisional = (start, summary, covered) if provisional else None
        return Planned(
            summary=summary,
            summarized_turns=covered,
            summarizing=self.active,
            start=start,
            provisional=provisional,
        )

    def status(self, state: SessionState) -> SummaryState:
        """Where the summary stands for ``state`` (picked up already): done, pending,
        running or failed, which turns it covers, its lag and the worker's backlog."""
        return summary_state(self.job(), state, active=self.active, backlog=self.worker.stats().backlog)

    def catch_up(
        self, timeout_s: float | None, *, sync: Callable[[], SessionState], history: History
    ) -> None:
        """Start jobs for the turns the summary owes (also after a failure, once per call)
        and wait for them, up to ``timeout_s`` in all (``None``: without limit).
        ``sync`` picks up a finished job and returns the session's state."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        submitted: set[int] = set()
        while True:
            state = sync()
            if not self.owes(state):
                return
            job = self.live_job()
            if job is None:
                last = self.job()
                if last is not None and id(last) in submitted and last.status is not JobStatus.DONE:
                    return  # a job of this call failed or was cancelled: report it
                job = self.submit(state, history, urgent=True)
                if job is None:
                    return
                submitted.add(id(job))
            self.worker.promote(job)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not job.wait(left):
                return

    def waits(
        self,
        limit: float | None,
        *,
        sync: Callable[[], SessionState],
        history: History,
        plan_start: Callable[[], int],
    ) -> Generator[SummaryWait, bool, float]:
        """The background summary a turn waits for, before it plans: it yields each job to
        wait for, with the seconds left (``None``: no limit), is sent whether the job
        ended, and returns the seconds it waited.

        ``sync`` picks up a finished summary and returns the session's state;
        ``plan_start`` is the first turn the turn's prompt would start at now. Turns the
        summary owes get a job (after a crash, a failure or a cancel: the stored turns are
        the source of truth). While the turns the summary misses cannot all be shown beside
        the window (the prompt would start at the window), the turn waits for the job (and
        the next one), at most ``limit`` seconds in all.
        """
        t0 = time.monotonic()
        deadline = None if limit is None else t0 + limit
        waited = 0.0
        while True:
            state = sync()
            job = self.live_job() or self.submit(state, history)
            shed = job is not None and job.error == BACKLOG_FULL
            if job is None or not self.owes(state) or (not job.live and not shed):
                return waited  # nothing to wait for: no plan needed (the turn plans next)
            # The prompt is the window, and the summary misses turns before it: wait for it.
            hides = plan_start() == state.evicted_turns
            if shed:  # (a full backlog sheds a job no turn waits for; this one would)
                if not hides:
                    return waited
                job = self.submit(state, history, urgent=True)
                if job is None or not job.live:
                    return waited
            left = None if deadline is None else deadline - time.monotonic()
            if not hides or (left is not None and left <= 0):
                return waited
            self.worker.promote(job)
            t_wait = time.monotonic()
            finished = yield SummaryWait(job, left)
            waited += time.monotonic() - t_wait
            if not finished or job.status is not JobStatus.DONE:
                logger.info(
                    "session %s: summary of turns %d-%d not in after %.1f s (%s); planning without it",
                    self.session_id, job.start, job.end, time.monotonic() - t0, job.status.value,
                )  # fmt: skip
                return waited

    def forget(self) -> None:
        """Cancel the session's queued or running job (only one of this epoch)."""
        if self.job() is not None:
            self.worker.forget(self.store, self.session_id)


def summary_state(
    job: SummaryJob | None, state: SessionState, *, active: bool, backlog: int = 0
) -> SummaryState:
    """The :class:`~convo.summarize.SummaryState` of a session whose stored state is
    ``state`` and whose last job (of its epoch) is ``job``; ``active``: the session
    summarizes. For :meth:`SessionSummary.status`, and for a reader that holds no
    session object (the server's ``GET /v1/sessions/{id}``)."""
    last = job
    if job is not None and job.end <= state.summarized_turns:
        job = None  # an older job that this session already picked up
    if state.evicted_turns <= state.summarized_turns or not active:
        status = SummaryStatus.DONE
    elif job is None or job.status in (JobStatus.CANCELLED, JobStatus.DONE):
        status = SummaryStatus.PENDING
    elif job.status is JobStatus.FAILED:
        status = SummaryStatus.FAILED
    elif job.status is JobStatus.RUNNING:
        status = SummaryStatus.RUNNING
    else:
        status = SummaryStatus.PENDING
    failed = job is not None and job.status is JobStatus.FAILED
    shed = job is not None and job.error == BACKLOG_FULL
    lag = None if last is None else (last.lag_s if last.lag_s is not None else last.last_lag_s)
    due = max(time.monotonic() - job.due_at, 0.0) if status is not SummaryStatus.DONE and job else 0.0
    return SummaryState(
        status=status,
        summarized_turns=state.summarized_turns,
        evicted_turns=state.evicted_turns,
        job_turns=(job.start, job.end) if job is not None else None,
        failures=(job.failures + int(failed)) if job is not None else 0,
        error=job.error if (failed or shed) and job is not None else "",
        lag_s=lag,
        due_s=due,
        backlog=backlog,
    )
