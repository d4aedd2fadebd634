"""Rolling summaries in the background: the :class:`SummaryWorker` that folds the turns
that left a session's window in its own threads, after the replies they follow; the
:class:`SummaryJob` it runs for one session; and what a session reports of it
(:class:`SummaryState`, :class:`SummaryStats`).

A session hands the turns that left its window to the worker once the reply is stored, and
returns; the worker folds them (with the session's :class:`~convo.summarize.Summarizer`,
its model calls marked ``Priority.BACKGROUND`` and ``owner=`` the session's ``cache_key``),
and stores the result with a compare-and-set (:meth:`~convo.stores.Store.save_summary`).
The stored turns stay the source of truth: a summary lost to a crash, a failure, a cancel
or a full backlog is derived again from them. Import these names from
:mod:`convo.summarize`, which re-exports them.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from convo.errors import ConfigError, SessionNotFound
from convo.messages import Message
from convo.metrics import Histogram, HistogramSnapshot

if TYPE_CHECKING:
    from convo.stores import Store

logger = logging.getLogger("convo.summarize")

#: Default of :attr:`SummaryWorker.threads`: summaries of this many sessions run at once
#: (an engine that batches concurrent calls, e.g. the static decoder, batches them).
DEFAULT_SUMMARY_THREADS = 4
#: Default of :attr:`SummaryWorker.max_defer_s`: how long a summary waits for replies in
#: flight to finish before it starts anyway (so replies go first, but summaries never starve).
DEFAULT_SUMMARY_DEFER_S = 2.0
#: Seconds the process-wide worker waits at interpreter exit for cancelled summaries to stop.
SHUTDOWN_TIMEOUT_S = 5.0
#: Finished jobs the worker remembers (one per session at most), so a session object that
#: was not there when its summary finished still picks the result up.
MAX_FINISHED_JOBS = 4096
#: Default of :attr:`SummaryWorker.max_backlog`: summaries queued (not yet started) at most.
#: A summary submitted beyond it is shed: it comes back cancelled with
#: :data:`BACKLOG_FULL`, its turns stay owed (stored, ``summarized_turns < evicted_turns``)
#: and the session's next turn submits them again, with the lag counted from when they
#: first became due. A bound keeps a load's summaries from piling up behind it and running
#: into the next load; a turn that waits for its summary (an urgent job) is never shed.
DEFAULT_SUMMARY_BACKLOG = 256
#: The error of a job shed because the backlog was full (see :data:`DEFAULT_SUMMARY_BACKLOG`).
BACKLOG_FULL = "summary backlog full: the turns stay owed and the next turn submits them again"
#: Bucket bounds of the summary lag histogram (``convo_summary_lag_seconds``), in seconds.
SUMMARY_LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@runtime_checkable
class Summarizer(Protocol):
    """Folds messages into a summary. The session injects one of these.

    Subclass it to inherit ``supports_cancel = False`` and ``supports_owner = False``, or
    declare both attributes (a summarizer that declares neither is refused when the session
    is built). A summarizer that declares ``supports_cancel`` takes ``cancel=`` (a
    :class:`threading.Event`) and stops its generation when it is set; one that declares
    ``supports_owner`` takes ``owner=``: the ``cache_key`` of the session it summarizes,
    which it passes to its model calls (``GenerateOptions.owner``) so that a KV-caching
    engine serves the summary from that session's own cached prefix or slot and never
    evicts another session for it. A summarizer of before ``supports_owner`` that
    subclasses this protocol keeps working: it is called without ``owner=``.

    One that declares ``supports_context = True`` takes ``context=`` (the declaration is
    optional: without it a summarizer is called without ``context=`` and still passes the
    check): where the session has it, the messages its last prompt started with, up to and
    including the turns to fold (the pinned part, the summary it showed, which is
    ``previous``, then ``messages``). Writing the summary as a continuation of them (the
    context, then an instruction) lets a KV-caching engine reuse the session's cached prompt:
    it prefills the instruction alone, not the turns again (issue 22).
    """

    #: :meth:`summarize` takes ``cancel=``.
    supports_cancel: bool = False
    #: :meth:`summarize` takes ``owner=`` (the summarized session's ``cache_key``).
    supports_owner: bool = False

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        """Return the new summary, at most ``max_tokens`` tokens long."""
        ...


class SummaryStatus(enum.StrEnum):
    """Where a session's rolling summary stands.

    ``DONE``: every turn that left the window is folded in. ``PENDING``: turns wait to be
    folded (queued, or owed after a crash / a cancelled job; the next turn starts a job).
    ``RUNNING``: a background job is folding them now. ``FAILED``: the last job raised; the
    next turn retries it.
    """

    DONE = "done"
    PENDING = "pending"
    RUNNING = "running"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class SummaryState:
    """A snapshot of a session's summary state.

    Attributes:
        status: see :class:`SummaryStatus`.
        summarized_turns: turns ``[0, summarized_turns)`` are in the stored summary.
        evicted_turns: turns ``[0, evicted_turns)`` have left the window.
        pending_turns: turns that left the window and are not summarized yet.
        job_turns: the turns the current (or last) job folds, ``(start, end)``, or ``None``.
        failures: failed attempts since the last success.
        error: the last failure's message (``""`` when none).
        lag_s: seconds from the last written summary's turns becoming due (leaving the
            window and being handed to the worker) to its being written; ``None`` when
            this worker wrote none for the session.
        due_s: seconds the turns the summary misses now have been due (0 when done).
        backlog: summaries the worker holds now, every session's (queued or running).
    """

    status: SummaryStatus
    summarized_turns: int
    evicted_turns: int
    job_turns: tuple[int, int] | None = None
    failures: int = 0
    error: str = ""
    lag_s: float | None = None
    due_s: float = 0.0
    backlog: int = 0

    @property
    def pending_turns(self) -> int:
        return max(self.evicted_turns - self.summarized_turns, 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the server's ``convo`` stats)."""
        return {
            "status": self.status.value,
            "summarized_turns": self.summarized_turns,
            "evicted_turns": self.evicted_turns,
            "pending_turns": self.pending_turns,
            "failures": self.failures,
            "error": self.error,
            "lag_s": None if self.lag_s is None else round(self.lag_s, 3),
            "due_s": round(self.due_s, 3),
            "backlog": self.backlog,
        }


class JobStatus(enum.StrEnum):
    """The life of one :class:`SummaryJob`."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(eq=False, kw_only=True)
class SummaryJob:
    """Fold turns ``[start, end)`` of one session into the summary that covers ``[0, start)``.

    Built by :meth:`SummaryWorker.submit`; everything it needs is copied in, so it never
    touches the session object. ``result`` is the new summary once ``status`` is ``DONE``.
    """

    store: Store
    session_id: str
    summarizer: Summarizer
    previous: str
    messages: tuple[Message, ...]
    start: int
    end: int
    max_tokens: int
    #: The epoch of the session the turns were read from (:attr:`SessionState.epoch`):
    #: the result is stored only into that session, never into one created later under
    #: the same id. ``None``: unfenced (a caller from before epochs).
    epoch: str | None = None
    failures: int = 0  # failed attempts of these turns before this one
    #: The ``cache_key`` of the session, passed to a summarizer that declares
    #: ``supports_owner`` (its model calls are served from that session's KV).
    owner: str | None = None
    #: The session's last prompt up to and including the turns to fold (see
    #: :class:`Summarizer`'s ``supports_context``); ``()``: the session had none to give.
    context: tuple[Message, ...] = ()
    status: JobStatus = JobStatus.QUEUED
    result: str = ""
    error: str = ""
    submitted_at: float = field(default_factory=time.monotonic)
    #: When the turns ``[start, end)`` became due (an earlier submission of them that was
    #: shed, failed or cancelled counts: the lag runs from the first).
    due_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    urgent: bool = False  # a turn waits for it: start it before others, without deferring
    #: :attr:`lag_s` of the session's last written summary before this job (``None``: none).
    last_lag_s: float | None = None
    #: Called (in the worker thread, no lock held) once the result is stored: the session
    #: prefills its next prompt's prefix (:meth:`Session.prefill_next`). Errors are logged.
    on_written: Callable[[SummaryJob], None] | None = field(default=None, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def live(self) -> bool:
        """Queued or running."""
        return self.status in (JobStatus.QUEUED, JobStatus.RUNNING)

    @property
    def lag_s(self) -> float | None:
        """Seconds from due to written, once ``DONE``; else ``None``."""
        if self.status is not JobStatus.DONE or self.finished_at is None:
            return None
        return self.finished_at - self.due_at

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the job ends (``None``: without limit); ``True`` if it has."""
        return self._done.wait(timeout_s)

    def cancel(self) -> None:
        """Drop the job if it has not started; ask a running one to stop (a summarizer
        that takes ``cancel=`` stops its generation; the result is discarded either way)."""
        self._cancel.set()


@dataclass(frozen=True, kw_only=True)
class SummaryStats:
    """What :meth:`SummaryWorker.stats` reports (``/metrics``: ``convo_summary_backlog``,
    ``convo_summary_lag_seconds``).

    Attributes:
        queued / running: summaries waiting to start / folding now.
        written: summaries stored. shed: submissions refused because the backlog was full
            (their turns stay owed). failed: attempts that raised.
        lag: seconds from due to written of every summary written (a histogram,
            :data:`SUMMARY_LAG_BUCKETS`).
    """

    queued: int
    running: int
    written: int
    shed: int
    failed: int
    lag: HistogramSnapshot

    @property
    def backlog(self) -> int:
        """Summaries the worker holds: queued or running."""
        return self.queued + self.running


class SummaryWorker:
    """Runs rolling summaries in background threads, after the replies they follow.

    A session hands the turns that left its window to the worker once the reply is
    stored, and returns; the summary is written later. The worker:

    * runs up to ``threads`` summaries at once (of different sessions; an engine that
      batches concurrent calls batches them); :class:`~convo.summarize.ModelSummarizer` asks for
      ``priority=Priority.BACKGROUND`` in its generate options, so the local engine's
      scheduler gives replies their slots and prefill budget first;
    * starts a summary only when no reply is generating (sessions report theirs through
      :meth:`replying`), or once it has waited ``max_defer_s``, or at once when a turn is
      waiting for it, so replies go first and summaries never starve;
    * passes the session's ``cache_key`` as ``owner=`` to a summarizer that declares
      ``supports_owner`` (:class:`~convo.summarize.ModelSummarizer` does), so a KV-caching engine runs the
      summary on that session's own KV, never in a slot that holds another session's;
    * holds at most ``max_backlog`` queued summaries: beyond it a submission is shed (its
      turns stay owed; see :data:`DEFAULT_SUMMARY_BACKLOG`), so a load leaves no pile of
      deferred summaries to run into the next one; and reports its backlog and each
      summary's lag, due to written (:meth:`stats`, :attr:`SummaryState.lag_s`);
    * persists a result with :meth:`Store.save_summary`, a compare-and-set on the covered
      turn count, so a stale job never overwrites a newer summary. The stored history stays
      the source of truth: a job lost to a crash or cancelled is simply run again (the
      turns it owed are still stored, and ``summarized_turns < evicted_turns`` says so).

    Sessions share :meth:`shared` (one per process) unless given their own, so that a
    server, which builds a session object per request, finds the job of the previous turn.

    A summary that has started is not preempted: on an engine that runs one call at a
    time (CPU, plain ``generate``), a reply that arrives meanwhile waits for it to end; an
    engine with a step scheduler can interleave the two, serving the background call last.

    Args:
        threads: summaries run at once. Default :data:`DEFAULT_SUMMARY_THREADS`.
        max_defer_s: seconds a summary waits for replies in flight before it starts anyway.
            Default :data:`DEFAULT_SUMMARY_DEFER_S`.
        max_backlog: summaries queued at most (not counting those running); beyond it a
            submission is shed. Default :data:`DEFAULT_SUMMARY_BACKLOG`.

    Example:
        >>> worker = SummaryWorker(threads=2)
        >>> session = Session(engine, summaries=worker)   # doctest: +SKIP
    """

    _shared: SummaryWorker | None = None
    _shared_guard = threading.Lock()

    def __init__(
        self,
        *,
        threads: int = DEFAULT_SUMMARY_THREADS,
        max_defer_s: float = DEFAULT_SUMMARY_DEFER_S,
        max_backlog: int = DEFAULT_SUMMARY_BACKLOG,
    ) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ConfigError(f"SummaryWorker.threads must be an int >= 1, got {threads!r}")
        if not max_defer_s >= 0:
            raise ConfigError(f"SummaryWorker.max_defer_s must be >= 0, got {max_defer_s!r}")
        if not isinstance(max_backlog, int) or isinstance(max_backlog, bool) or max_backlog < 1:
            raise ConfigError(f"SummaryWorker.max_backlog must be an int >= 1, got {max_backlog!r}")
        self.threads = threads
        self.max_defer_s = float(max_defer_s)
        self.max_backlog = max_backlog
        self._running = 0
        self._written = 0
        self._shed = 0
        self._failed = 0
        self._lag = Histogram(
            "convo_summary_lag_seconds",
            "seconds from a summary becoming due to its being written",
            buckets=SUMMARY_LAG_BUCKETS,
        )
        self._cond = threading.Condition()
        self._queue: list[SummaryJob] = []
        # Keyed by (id(store), session id); the job holds its store, so the id stays valid.
        self._jobs: OrderedDict[tuple[int, str], SummaryJob] = OrderedDict()
        self._replies = 0
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._key_locks = [threading.Lock() for _ in range(64)]

    @classmethod
    def shared(cls, *, min_threads: int | None = None, max_defer_s: float | None = None) -> SummaryWorker:
        """The process-wide worker that sessions use by default.

        Args:
            min_threads: raise its thread count (a server whose engine batches N calls,
                e.g. N KV slots, runs N summaries at once).
            max_defer_s: lower its deferral (an engine whose scheduler serves replies first
                by priority needs none: 0).
        """
        with cls._shared_guard:
            if cls._shared is None or cls._shared._closed:
                cls._shared = cls()
                # At exit, stop summaries mid-generation rather than let the interpreter
                # tear down under them (they are re-derived on the next turn).
                atexit.register(cls._shared.close, wait=True, timeout_s=SHUTDOWN_TIMEOUT_S)
            worker = cls._shared
        with worker._cond:
            if min_threads is not None:
                worker.threads = max(worker.threads, int(min_threads))
            if max_defer_s is not None:
                worker.max_defer_s = min(worker.max_defer_s, float(max_defer_s))
        return worker

    # -- what sessions call ---------------------------------------------------------------------
    @contextmanager
    def replying(self) -> Iterator[None]:
        """Mark a reply in flight for as long as the block runs (summaries defer to it)."""
        with self._cond:
            self._replies += 1
        try:
            yield
        finally:
            with self._cond:
                self._replies -= 1
                self._cond.notify_all()

    def key_lock(self, store: Store, session_id: str) -> threading.Lock:
        """The lock under which a job's result and a session's state writes of one session
        are ordered in this process (a session syncs and writes under it)."""
        return self._key_locks[hash((id(store), session_id)) % len(self._key_locks)]

    def job(self, store: Store, session_id: str) -> SummaryJob | None:
        """The live or last finished job of a session, if this worker has one."""
        with self._cond:
            return self._jobs.get((id(store), session_id))

    def stats(self) -> SummaryStats:
        """The backlog now, and the counts and lags so far (see :class:`SummaryStats`)."""
        with self._cond:
            queued = sum(1 for j in self._queue if not j._cancel.is_set())
            return SummaryStats(
                queued=queued,
                running=self._running,
                written=self._written,
                shed=self._shed,
                failed=self._failed,
                lag=self._lag.snapshot_of(),
            )

    def submit(
        self,
        *,
        store: Store,
        session_id: str,
        summarizer: Summarizer,
        previous: str,
        messages: Sequence[Message],
        start: int,
        end: int,
        max_tokens: int,
        epoch: str | None = None,
        owner: str | None = None,
        urgent: bool = False,
        on_written: Callable[[SummaryJob], None] | None = None,
        context: Sequence[Message] = (),
    ) -> SummaryJob:
        """Queue a job, unless one is live for the session (then that one is returned: it
        must end first, as the next job folds into its result). On a closed worker the job
        comes back cancelled; beyond ``max_backlog`` queued jobs it comes back cancelled
        with :data:`BACKLOG_FULL` (shed), unless ``urgent``.

        ``epoch``: the session's (:attr:`~convo.stores.SessionState.epoch`); the job stores
        its result only into the session of that epoch. A live job of another epoch (of a
        session deleted since, whose id was reused) is cancelled and replaced. ``owner``:
        the session's ``cache_key`` (see :attr:`SummaryJob.owner`). ``urgent``: a turn
        waits for it (never shed, started first). ``on_written``: see
        :attr:`SummaryJob.on_written`. ``context``: see :attr:`SummaryJob.context`."""
        key = (id(store), session_id)
        with self._cond:
            last = self._jobs.get(key)
            if last is not None and last.live:
                if last.epoch == epoch:
                    return last
                last.cancel()  # the turns of another session under this id: never stored
                self._cond.notify_all()
                last = None
            retried = last is not None and last.status is JobStatus.FAILED and last.epoch == epoch
            failures = last.failures + 1 if retried and last is not None else 0
            prior = last if last is not None and last.epoch == epoch else None
            now = time.monotonic()
            # The lag runs from when these turns first became due (a shed, failed or
            # cancelled submission of them counts), not from this submission.
            owed = prior is not None and prior.start == start and prior.status is not JobStatus.DONE
            owed_since = prior.due_at if owed and prior is not None else now
            last_lag = (
                None if prior is None else (prior.lag_s if prior.lag_s is not None else prior.last_lag_s)
            )
            job = SummaryJob(
                store=store,
                session_id=session_id,
                summarizer=summarizer,
                previous=previous,
                messages=tuple(messages),
                start=start,
                end=end,
                max_tokens=max_tokens,
                epoch=epoch,
                failures=failures,
                owner=owner,
                context=tuple(context),
                due_at=owed_since,
                urgent=urgent,
                on_written=on_written,
                last_lag_s=last_lag,
            )
            if self._closed:  # shutting down: the turns stay owed (the next turn retries)
                job.status, job.finished_at = JobStatus.CANCELLED, time.monotonic()
                job._done.set()
                return job
            if not urgent and len(self._queue) >= self.max_backlog:
                # Shed: the turns stay owed; kept as the session's last job so that its
                # state says so and the next submission's lag counts from now.
                job.status, job.finished_at, job.error = JobStatus.CANCELLED, now, BACKLOG_FULL
                job.on_written, job.messages, job.context = None, (), ()
                job._done.set()
                self._shed += 1
                self._jobs[key] = job
                self._jobs.move_to_end(key)
                logger.info("summary of %s turns %d-%d shed: backlog full", session_id, start, end)
                return job
            self._jobs[key] = job
            self._jobs.move_to_end(key)
            self._queue.append(job)
            self._trim()
            if len(self._workers) < self.threads:
                t = threading.Thread(target=self._loop, name="convo-summary", daemon=True)
                self._workers.append(t)
                t.start()
            self._cond.notify_all()
            logger.debug("summary of %s turns %d-%d queued", session_id, start, end)
            return job

    def forget(self, store: Store, session_id: str) -> None:
        """Cancel the session's job, if live, and drop what the worker keeps of it (a
        closed session: a throw-away session's store is not kept alive by its job)."""
        with self.key_lock(store, session_id), self._cond:
            job = self._jobs.pop((id(store), session_id), None)
            if job is not None and job.live:
                job.cancel()  # under the key lock: a job past this point stores nothing
                self._cond.notify_all()

    def promote(self, job: SummaryJob) -> None:
        """A turn waits for ``job``: start it next, without deferring to replies."""
        with self._cond:
            job.urgent = True
            self._cond.notify_all()

    def close(self, *, wait: bool = True, timeout_s: float | None = None) -> None:
        """Cancel every queued and running job and stop the threads (``wait``: join them,
        up to ``timeout_s`` in all). Nothing is lost: the turns a cancelled job owed are
        stored, and the session's next turn summarizes them again."""
        with self._cond:
            self._closed = True
            for job in self._jobs.values():
                if job.live:
                    job.cancel()
            self._cond.notify_all()
            workers = list(self._workers)
        if wait:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            for t in workers:
                t.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))

    # -- the worker threads -----------------------------------------------------------------------
    def _trim(self) -> None:
        finished = [k for k, j in self._jobs.items() if not j.live]
        for k in finished[: max(len(finished) - MAX_FINISHED_JOBS, 0)]:
            del self._jobs[k]

    def _next(self) -> SummaryJob | None:
        """The next job to run (urgent first, then oldest), waiting as the policy says."""
        with self._cond:
            while True:
                self._queue = [j for j in self._queue if not self._drop_cancelled(j)]
                if self._closed and not self._queue:
                    return None
                if self._queue:
                    job = min(self._queue, key=lambda j: (not j.urgent, j.submitted_at))
                    wait = job.submitted_at + self.max_defer_s - time.monotonic()
                    if job.urgent or self._replies == 0 or wait <= 0 or self._closed:
                        self._queue.remove(job)
                        job.status, job.started_at = JobStatus.RUNNING, time.monotonic()
                        self._running += 1
                        return job
                    self._cond.wait(wait)
                else:
                    self._cond.wait()

    @staticmethod
    def _drop_cancelled(job: SummaryJob) -> bool:
        if not job._cancel.is_set():
            return False
        job.status, job.finished_at = JobStatus.CANCELLED, time.monotonic()
        job.on_written = None  # (it holds the session object)
        job._done.set()
        return True

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            self._run(job)

    def _run(self, job: SummaryJob) -> None:
        kwargs: dict[str, Any] = {"cancel": job._cancel} if job.summarizer.supports_cancel else {}
        if job.summarizer.supports_owner:
            kwargs["owner"] = job.owner
        # (optional declaration, see Summarizer: absent on summarizers written before it)
        if job.context and getattr(job.summarizer, "supports_context", False):
            kwargs["context"] = job.context
        try:
            # The summarizer asks for background priority in its generate options
            # (ModelSummarizer does), so a batching engine serves replies first.
            summary = job.summarizer.summarize(
                previous=job.previous, messages=job.messages, max_tokens=job.max_tokens, **kwargs
            )
            with self.key_lock(job.store, job.session_id):
                if job._cancel.is_set():  # (checked under the lock: see forget)
                    status, error = JobStatus.CANCELLED, ""
                else:
                    fence = {} if job.epoch is None else {"epoch": job.epoch}
                    saved = job.store.save_summary(
                        job.session_id,
                        summary=summary,
                        covered_from=job.start,
                        summarized_turns=job.end,
                        **fence,
                    )
                    status, error = (JobStatus.DONE if saved else JobStatus.CANCELLED), ""
                    if saved:
                        # Visible to sessions in the same critical section as the store
                        # write, so no session state write can roll it back in between.
                        job.result, job.status = summary, status
                        logger.info(
                            "session %s: folded turns %d-%d into the summary in the background (%.1f s)",
                            job.session_id, job.start, job.end - 1, time.monotonic() - (job.started_at or 0),
                        )  # fmt: skip
                    else:
                        logger.info(
                            "summary of %s turns %d-%d is stale (the store moved on); dropped",
                            job.session_id, job.start, job.end,
                        )  # fmt: skip
        except SessionNotFound:  # deleted while its summary ran: nothing to store
            status, error = JobStatus.CANCELLED, ""
        except Exception as exc:  # reported through the session's summary state, retried
            status, error = JobStatus.FAILED, f"{type(exc).__name__}: {exc}"
            logger.warning(
                "summary of session %s (turns %d-%d) failed (attempt %d): %s",
                job.session_id, job.start, job.end, job.failures + 1, error,
            )  # fmt: skip
        with self._cond:
            job.status, job.error, job.finished_at = status, error, time.monotonic()
            job.messages = job.context = ()  # the turns are stored; do not keep a copy
            self._running -= 1
            if status is JobStatus.DONE:
                self._written += 1
                self._lag.observe(job.finished_at - job.due_at)
            elif status is JobStatus.FAILED:
                self._failed += 1
            callback, job.on_written = job.on_written, None  # (it holds the session object)
            self._cond.notify_all()
        if callback is not None and status is JobStatus.DONE:
            try:
                callback(job)
            except Exception:  # the summary is stored; only the head start is lost
                logger.exception("session %s: after-summary callback failed", job.session_id)
        job._done.set()
