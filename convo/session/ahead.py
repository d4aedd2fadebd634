"""Work a session does ahead, off its turns' path: embedding the turn it just answered.

A turn hands its completed turns to the retriever before it plans (they must be
searchable once they leave the window), and the embedding that indexing needs was, in
the server, the largest part of a turn's time before its prompt reached the engine:
sixteen concurrent turns each embedding their previous turn and their question took
about 2 s of time to first token on an H200 (issue 24). So after each reply the session
gives its new turns to a :class:`~convo.plan.PreparesTurns` retriever in a background
thread (:func:`prepare_later`); the retriever computes their vectors into its embedder's
caches, and the next turn's indexing only looks them up. Nothing is indexed or stored
here. A retriever that a session searches alone (``defer_window_turns``) is handed a turn
its window still shows only once its vectors are ready (``turns_ready``), and at the
latest when it leaves the window: a job that is dropped, fails or comes late never costs
a turn embedding on its path before it must (a restart catches up at once: the server's
index is rebuilt then).

The threads are shared by every session of the process (:data:`AHEAD_WORKERS`), their
queue is bounded (:data:`MAX_AHEAD_BACKLOG`), and :func:`ahead_stats` counts their work.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from convo.background import background_work
from convo.plan import PreparesTurns, Turn

logger = logging.getLogger(__name__)

#: Threads that embed ahead for every session of the process (their embedder calls share
#: forward passes, see :class:`~convo.embeddings.Embedder`).
AHEAD_WORKERS = 2
#: Jobs that may wait for those threads; past it a new job is dropped (the next turn
#: embeds what it needs itself, as it would without them).
MAX_AHEAD_BACKLOG = 1024
#: Seconds the process waits, when it exits, for a job that is running (queued ones are
#: dropped): a thread still in the embedder's native code when Python finalizes aborts it.
AHEAD_EXIT_WAIT_S = 10.0


@dataclass(frozen=True)
class AheadStats:
    """What the threads did since the process started (``/metrics`` shows it).

    Attributes:
        submitted / done / dropped / failed: jobs.
        texts: texts embedded ahead.
        backlog: jobs waiting now.
        busy_s: seconds the threads spent on jobs.
    """

    submitted: int
    done: int
    dropped: int
    failed: int
    texts: int
    backlog: int
    busy_s: float


class AheadPool:
    """Daemon threads (started on the first job) that run ``prepare`` jobs in order.

    Args:
        workers: threads (default :data:`AHEAD_WORKERS`).
        max_backlog: jobs waiting at most (default :data:`MAX_AHEAD_BACKLOG`).
    """

    def __init__(self, workers: int = AHEAD_WORKERS, max_backlog: int = MAX_AHEAD_BACKLOG) -> None:
        self.workers = max(1, workers)
        self._jobs: queue.Queue[Callable[[], int]] = queue.Queue(maxsize=max(1, max_backlog))
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # jobs queued or running
        self._submitted = self._done = self._dropped = self._failed = self._texts = 0
        self._busy_s = 0.0
        self._closed = False

    def submit(self, job: Callable[[], int]) -> bool:
        """Queue ``job`` (it returns the texts it embedded); False when the queue is full."""
        with self._lock:
            self._submitted += 1
            if self._closed:
                self._dropped += 1
                return False
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self._dropped += 1
                return False
            self._pending += 1
            if len(self._threads) < self.workers:
                t = threading.Thread(target=self._loop, name="convo-ahead", daemon=True)
                self._threads.append(t)
                t.start()
        return True

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until no job waits or runs (tests; a clean shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float = AHEAD_EXIT_WAIT_S) -> None:
        """Take no more jobs, drop the queued ones and wait for the running ones."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
                self._pending -= 1
                self._dropped += 1
        self.drain(timeout_s)

    def stats(self) -> AheadStats:
        with self._lock:
            return AheadStats(
                submitted=self._submitted,
                done=self._done,
                dropped=self._dropped,
                failed=self._failed,
                texts=self._texts,
                backlog=self._jobs.qsize(),
                busy_s=self._busy_s,
            )

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            started = time.monotonic()
            texts, failed = 0, False
            try:
                with background_work():  # the embedder serves turns' own calls first
                    texts = job()
            except Exception:  # (the next turn embeds what it needs itself)
                logger.exception("embedding a turn ahead failed")
                failed = True
            with self._idle:
                self._pending -= 1
                self._busy_s += time.monotonic() - started
                self._texts += texts
                self._done += not failed
                self._failed += failed
                self._idle.notify_all()


_POOL = AheadPool()
atexit.register(_POOL.close)


def prepare_later(
    retriever: PreparesTurns, session_id: str, turns: Sequence[Turn], dates: Mapping[int, str]
) -> bool:
    """Have ``retriever`` embed ``turns`` of ``session_id`` (dated by ``dates``, which may
    hold other turns too) ahead, in the process's background threads; False when their
    queue is full (nothing is lost: the turn that indexes them embeds them itself)."""
    turns = list(turns)  # (the session goes on; the job keeps its copy)
    dates = {t.index: dates[t.index] for t in turns if t.index in dates}
    return _POOL.submit(lambda: retriever.prepare_turns(session_id, turns, dates=dates))


def ahead_stats() -> AheadStats:
    """What the process's embed-ahead threads did (see :class:`AheadStats`)."""
    return _POOL.stats()


def drain_ahead(timeout_s: float = 30.0) -> bool:
    """Wait until the process's embed-ahead threads are idle; False on timeout."""
    return _POOL.drain(timeout_s)
