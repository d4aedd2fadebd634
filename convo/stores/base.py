"""What every session store shares: :class:`Store` (the interface), :class:`SessionState`
(a session's state without its messages), the per-thread reentrant turn lock, and
:func:`redact_url`.

A store keeps *everything*: every message ever sent, even those the prompt no longer
shows. A session's state is small and append-only, so each turn is one transaction. The
implementations live next to this file: :mod:`convo.stores.memory`,
:mod:`convo.stores.sqlite`, :mod:`convo.stores.redis`.
"""

from __future__ import annotations

import abc
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from convo.errors import SessionBusy, SessionNotFound, StoreError
from convo.messages import Message

logger = logging.getLogger(__name__)

#: Version of the export format written by :meth:`Store.export_session`.
EXPORT_FORMAT = "convo.session/1"

#: The ``settings`` key that makes a session a *fork* sharing its parent's first messages:
#: ``{"parent": "<id>", "prefix": n}``. A fork stores only its own messages (its tail);
#: :meth:`Store.load` returns the parent's first ``n`` stored messages followed by them, and
#: a fork whose parent is gone reads as missing. Whoever truncates a parent below ``n``
#: keeps the fork whole first (the server does, see ``convo.server.turns``); an export is
#: the stitched history without this key (self-contained).
FORK_SETTING = "fork"


@dataclass(frozen=True, kw_only=True)
class SessionState:
    """Everything a session needs to resume, except its messages.

    Attributes:
        session_id: the id.
        settings: JSON-safe settings (budget, system prompt...), as the session wrote them.
        summary: the rolling summary text.
        summarized_turns: turns ``[0, summarized_turns)`` are folded into the summary.
        evicted_turns: turns ``[0, evicted_turns)`` have left the prompt window.
        owner: who created the session (e.g. an API-key hash), or ``""``.
        created_at / updated_at: UNIX seconds.
        epoch: the session's identity, minted by the store each time it creates the
            session (:func:`new_epoch`; the value passed to ``create`` is ignored) and
            never changed after. An id can be deleted and created again (``DELETE`` then a
            new session, a server fork rewriting it); the epoch tells the two apart, so
            background work bound to the old one (a summary job) is refused by the new one
            (:meth:`Store.save_summary`). ``""``: a session stored before epochs existed
            (:data:`LEGACY_EPOCH`); it still loads and works, and work bound to it is
            refused by every session created since.
    """

    session_id: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""
    summarized_turns: int = 0
    evicted_turns: int = 0
    owner: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    epoch: str = ""


@dataclass(frozen=True)
class StoredTail:
    """What :meth:`Store.load_tail` returns: one consistent snapshot of a session's state,
    its number of stored messages, and the messages from a position on.

    Attributes:
        state: the state.
        count: how many messages are stored in all.
        after: the position the tail starts at (messages ``[after, count)``).
        messages: those messages, in order.
    """

    state: SessionState
    count: int
    after: int
    messages: list[Message]


@dataclass(frozen=True)
class MemoryLog:
    """What :meth:`Store.memory_log` returns: one retrieval-memory scope's records.

    A *scope* is a session's own memory (its id) or a person's (see
    :mod:`convo.retrieval.scopes`); its *records* are JSON-safe dicts, append-only, each
    written by one session (``session_id``), so deleting that session deletes them.

    Attributes:
        scope: the scope.
        count: how many records the scope holds in all.
        after: the position the records below start at.
        records: records ``[after, count)``, in order.
    """

    scope: str
    count: int
    after: int
    records: list[dict[str, Any]]


#: The epoch of a session stored before epochs existed (see :attr:`SessionState.epoch`).
LEGACY_EPOCH = ""

#: Separates a session id from the number of a fork holding its replaced tail
#: (``<id>~<n>``, see :mod:`convo.server.reconcile`); forks of forks nest (``<id>~1~2``).
FORK_SEPARATOR = "~"


def new_epoch() -> str:
    """A fresh session epoch (32 hex characters, random)."""
    return uuid.uuid4().hex


def is_fork_of(candidate: str, session_id: str) -> bool:
    """Whether ``candidate`` names a fork of ``session_id`` (``<id>~<n>``, or a fork of
    one of those, ``<id>~<n>~<m>``...)."""
    prefix = session_id + FORK_SEPARATOR
    return candidate.startswith(prefix) and _FORK_TAIL.fullmatch(candidate[len(prefix) :]) is not None


_FORK_TAIL = re.compile(r"[1-9][0-9]*(?:~[1-9][0-9]*)*")


class Store(abc.ABC):
    """The interface every store implements (in-memory, SQLite, Redis...)."""

    @abc.abstractmethod
    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        """Create a session with its first ``messages`` (e.g. the system prompt), in one
        transaction: a session is never seen half-made. Raises StoreError if the id exists."""

    def create_if_missing(self, state: SessionState, messages: Sequence[Message] = ()) -> bool:
        """Create the session as :meth:`create` does unless it exists already; returns
        whether this call created it. Idempotent: of several writers (threads, processes)
        creating one new session at once, exactly one creates it and the others see it
        made, none fails with "already exists".

        The stores here do it in one atomic step (a dict lock, a SQLite transaction, a
        Redis script); this default (for other stores) checks and creates under
        :meth:`lock`, so it is atomic among callers of ``create_if_missing``.
        """
        with self.lock(state.session_id):
            if self.exists(state.session_id):
                return False
            try:
                self.create(state, messages)
            except StoreError:
                if self.exists(state.session_id):  # a plain create() won the race
                    return False
                raise
            return True

    @abc.abstractmethod
    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        """State and full history. Raises SessionNotFound."""

    def _stitched(self, state: SessionState, messages: list[Message]) -> list[Message]:
        """A fork's whole history: its parent's shared prefix, then its own ``messages``
        (see :data:`FORK_SETTING`); any other session's ``messages`` as they are. Stores
        call it from :meth:`load`, outside their own locks."""
        link = state.settings.get(FORK_SETTING)
        if not isinstance(link, Mapping):
            return messages
        try:
            _, parent = self.load(str(link["parent"]))
        except SessionNotFound:
            raise SessionNotFound(f"no session {state.session_id!r} (its parent is gone)") from None
        return [*parent[: int(link["prefix"])], *messages]

    def truncate(self, session_id: str, keep: int, *, state: SessionState | None = None) -> None:
        """Keep the first ``keep`` stored messages (a fork's own: its tail) and drop the
        rest, optionally replacing the state, in one transaction. Forks sharing more than
        ``keep`` messages of this session are the caller's to keep whole (see
        :data:`FORK_SETTING`). The session gets a new epoch (:attr:`SessionState.epoch`):
        its history is no longer an extension of the one before, so work bound to that one
        (a background summary of turns it dropped, a copy a process keeps) is refused.

        The stores here do it in one transaction; this default (for other stores) deletes
        and re-creates the session.

        Raises:
            SessionNotFound: no such session.
        """
        old, messages = self.load(session_id)
        if isinstance(old.settings.get(FORK_SETTING), Mapping):
            messages = messages[int(old.settings[FORK_SETTING]["prefix"]) :]
        self.delete(session_id)
        self.create(state or old, messages[:keep])

    @abc.abstractmethod
    def exists(self, session_id: str) -> bool:
        """Whether the session exists."""

    @abc.abstractmethod
    def append(
        self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None
    ) -> None:
        """Append messages (and optionally replace the state) in one transaction."""

    @abc.abstractmethod
    def save_state(self, state: SessionState) -> None:
        """Replace the state (summary, counters, settings) of an existing session."""

    def save_summary(
        self,
        session_id: str,
        *,
        summary: str,
        covered_from: int,
        summarized_turns: int,
        epoch: str | None = None,
    ) -> bool:
        """Store a summary that folds turns ``[covered_from, summarized_turns)`` into the one
        that covered ``[0, covered_from)``, only if the stored state still says
        ``summarized_turns == covered_from`` (a compare-and-set: a late or repeated background
        job never overwrites a newer summary) and, with ``epoch``, only if the stored
        session is still the one of that epoch (a fence: the summary of a deleted session
        never lands in a new session under the same id, see :attr:`SessionState.epoch`).
        ``epoch=None``: unfenced (callers from before epochs). Returns whether it was stored.

        The stores here do it atomically; this default (for other stores) reads and writes
        the state without a transaction.

        Raises:
            SessionNotFound: no such session.
        """
        state, _ = self.load(session_id)
        if state.summarized_turns != covered_from or (epoch is not None and state.epoch != epoch):
            return False
        self.save_state(replace(state, summary=summary, summarized_turns=summarized_turns))
        return True

    @abc.abstractmethod
    def delete(self, session_id: str, *, forks: bool = False) -> None:
        """Delete a session and its history, in one transaction; with ``forks``, also its
        forks (``<id>~<n>`` and their forks, those of the same owner: see
        :meth:`forks_of`), so that what a deleted session held is readable nowhere.
        ``forks=False`` keeps them (a server fork rewrites a session with delete and
        create, and its fork must stay). Raises SessionNotFound (``session_id`` missing)."""

    def forks_of(self, session_id: str) -> list[str]:
        """The forks of ``session_id`` that :meth:`delete` with ``forks=True`` removes:
        every ``<id>~<n>`` (and ``<id>~<n>~<m>``...) with the same owner. Raises
        SessionNotFound. This default reads the list of sessions; the stores here query
        only the ids that start with ``<id>~``."""
        owner = self.peek(session_id)[0].owner
        found = []
        for sid in self.list_sessions():
            if is_fork_of(sid, session_id):
                try:
                    if self.peek(sid)[0].owner == owner:
                        found.append(sid)
                except SessionNotFound:
                    continue
        return found

    @abc.abstractmethod
    def list_sessions(self) -> list[str]:
        """All session ids."""

    def peek(self, session_id: str) -> tuple[SessionState, int]:
        """The state and the number of stored messages, without reading the messages
        (a session checks with it whether another process wrote since it last looked).
        Raises SessionNotFound."""
        state, messages = self.load(session_id)
        return state, len(messages)

    def load_tail(self, session_id: str, after: int) -> StoredTail:
        """The state, the message count and the messages stored at positions ``after..``,
        in one snapshot, reading only those (a session that knows the first ``after``
        messages of this epoch catches up with what was appended since: a store's history
        is append-only within an epoch, see :attr:`SessionState.epoch`). The stores here
        read an index range (SQLite) or ``LRANGE`` (Redis); this default loads everything
        and slices. Raises SessionNotFound."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        state, messages = self.load(session_id)
        return StoredTail(state=state, count=len(messages), after=after, messages=messages[after:])

    def export_session(self, session_id: str) -> dict[str, Any]:
        """A JSON-safe dict with the whole session (state and every message)."""
        state, messages = self.load(session_id)
        return {
            "format": EXPORT_FORMAT,
            "session_id": state.session_id,
            "settings": {k: v for k, v in state.settings.items() if k != FORK_SETTING},
            "summary": state.summary,
            "summarized_turns": state.summarized_turns,
            "evicted_turns": state.evicted_turns,
            "owner": state.owner,
            "created_at": state.created_at,
            "updated_at": state.updated_at,
            "messages": [m.to_record() for m in messages],
            # The session's retrieval memory (what its index is rebuilt from).
            "memory": self.memory_log(session_id).records,
        }

    def import_session(self, data: Mapping[str, Any], *, session_id: str | None = None) -> str:
        """Create a session from :meth:`export_session` output; returns its id.

        Raises:
            StoreError: the data is not a convo export, or the id already exists.
        """
        if data.get("format") != EXPORT_FORMAT:
            raise StoreError(f"not a convo session export (format {data.get('format')!r})")
        sid = session_id or str(data["session_id"])
        messages = [Message.from_record(r) for r in data.get("messages", [])]
        now = time.time()
        state = SessionState(
            session_id=sid,
            settings=dict(data.get("settings", {})),
            summary=str(data.get("summary", "")),
            summarized_turns=int(data.get("summarized_turns", 0)),
            evicted_turns=int(data.get("evicted_turns", 0)),
            owner=str(data.get("owner", "")),
            created_at=float(data.get("created_at", now)),
            updated_at=now,
        )
        self.create(state, messages)
        memory = data.get("memory") or []
        if memory:
            self.append_memory(sid, [dict(r) for r in memory], session_id=sid)
        return sid

    # -- retrieval memory: records kept with the session ------------------------------------
    #: Whether memory records outlive the process (SQLite, Redis: ``True``). This default
    #: keeps them in the process, which is what :class:`~convo.stores.InMemoryStore` wants.
    memory_persisted: bool = False

    def append_memory(
        self,
        scope: str,
        records: Sequence[Mapping[str, Any]],
        *,
        session_id: str | None,
        epoch: str | None = None,
    ) -> bool:
        """Append retrieval-memory ``records`` to ``scope``, written by ``session_id``, in
        one transaction; only if that session exists and, with ``epoch``, is still the one
        of that epoch (the fence a summary has: memory of a deleted session never lands in
        a new one under the same id). Called under the session's :meth:`lock` (Redis
        fences it with the lease, as it fences a turn). Returns whether it was stored.
        ``session_id=None``: rows of no session (documents), appended unfenced.

        The records are deleted with the session (:meth:`delete`), in every scope: a
        store deletes the rows each session wrote, whatever scope they are in."""
        if session_id is not None:
            try:
                state, _ = self.peek(session_id)
            except SessionNotFound:
                return False
            if epoch is not None and state.epoch != epoch:
                return False
        rows = [(session_id or "", dict(r)) for r in records]
        with _LOCKS_GUARD:
            self._memory_rows().setdefault(scope, []).extend(rows)
        return True

    def memory_log(self, scope: str, after: int = 0) -> MemoryLog:
        """The records of ``scope`` from position ``after`` on (an empty log for a scope
        never written)."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        with _LOCKS_GUARD:
            rows = list(self._memory_rows().get(scope, []))
        return MemoryLog(scope=scope, count=len(rows), after=after, records=[r for _, r in rows[after:]])

    def memory_counts(self, scopes: Sequence[str]) -> dict[str, int]:
        """How many records each scope holds (a cheap check whether a cached index is behind)."""
        with _LOCKS_GUARD:
            rows = self._memory_rows()
            return {s: len(rows.get(s, [])) for s in scopes}

    def delete_memory(self, scope: str) -> int:
        """Delete every record of ``scope`` (a person's memory forgotten); returns how many."""
        with _LOCKS_GUARD:
            return len(self._memory_rows().pop(scope, []))

    def _memory_rows(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        rows: dict[str, list[tuple[str, dict[str, Any]]]] = self.__dict__.setdefault("_memory", {})
        return rows

    def _drop_memory_of(self, session_ids: Sequence[str]) -> None:
        """Drop the in-process records written by ``session_ids`` (their own scopes too)."""
        doomed = set(session_ids)
        with _LOCKS_GUARD:
            rows = self._memory_rows()
            for scope in list(rows):
                kept = [r for r in rows[scope] if r[0] not in doomed]
                if kept:
                    rows[scope] = kept
                else:
                    rows.pop(scope)

    def lock(self, session_id: str, timeout_s: float = 60.0) -> AbstractContextManager[None]:
        """Hold ``session_id`` for one turn: other holders of the same store wait.

        The default is an in-process lock; :class:`~convo.stores.SQLiteStore` locks a
        file and :class:`~convo.stores.RedisStore` a key, so turns of one session never
        interleave across processes either. The lock is reentrant within a thread: a :class:`~convo.Session`
        used inside ``with store.lock(id):`` does not wait for itself.

        Args:
            session_id: the session (it need not exist yet).
            timeout_s: seconds to wait for another holder before :class:`SessionBusy`.
        """
        return self._reentrant(session_id, timeout_s)

    def ping(self) -> None:
        """Raise :class:`StoreError` unless the store answers (for health checks)."""
        try:
            self.exists("convo-ping")
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"the session store does not answer: {type(exc).__name__}") from exc

    def holds_lock(self, session_id: str) -> bool:
        """Whether the calling thread holds ``session_id``'s lock (see :meth:`lock`)."""
        return self._held().get(session_id, 0) > 0

    def after_release(self, session_id: str, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the calling thread lets go of ``session_id``'s lock (at once when
        it does not hold it): work a turn inside an outer holder's lock (a server request's)
        leaves for when the session is free, such as prefilling its next prompt. An error in
        ``fn`` is logged, not raised."""
        if not self.holds_lock(session_id):
            _call_logged(fn)
            return
        waiting: dict[str, list[Callable[[], None]]] = self._thread_local().__dict__.setdefault("after", {})
        waiting.setdefault(session_id, []).append(fn)

    def _thread_local(self) -> threading.local:
        with _LOCKS_GUARD:
            local: threading.local = self.__dict__.setdefault("_held_locks", threading.local())
        return local

    def _held(self) -> dict[str, int]:
        local = self._thread_local()
        held: dict[str, int] | None = getattr(local, "depth", None)
        if held is None:
            held = local.depth = {}
        return held

    @contextmanager
    def _reentrant(self, session_id: str, timeout_s: float) -> Iterator[None]:
        held = self._held()
        if held.get(session_id, 0) > 0:
            held[session_id] += 1
            try:
                yield
            finally:
                held[session_id] -= 1
            return
        try:
            with self._acquire(session_id, timeout_s):
                held[session_id] = 1
                try:
                    yield
                finally:
                    del held[session_id]
        finally:  # the lock is let go of: what waited for that (after_release)
            for fn in self._thread_local().__dict__.get("after", {}).pop(session_id, []):
                _call_logged(fn)

    def _acquire(self, session_id: str, timeout_s: float) -> AbstractContextManager[None]:
        """Take the lock for a thread that does not hold it yet (stores override this)."""
        with _LOCKS_GUARD:
            locks: dict[str, threading.Lock] = self.__dict__.setdefault("_session_locks", {})
            held = locks.setdefault(session_id, threading.Lock())
        return _hold(held, session_id, timeout_s)

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections."""


_LOCKS_GUARD = threading.Lock()


def _call_logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # (work left for after a turn: its failure must not fail the caller)
        logger.exception("work run after a session's lock was let go of failed")


@contextmanager
def _hold(lock: threading.Lock, session_id: str, timeout_s: float) -> Iterator[None]:
    if not lock.acquire(timeout=timeout_s):
        raise SessionBusy(f"session {session_id!r} is busy with another turn (waited {timeout_s:.0f} s)")
    try:
        yield
    finally:
        lock.release()


def redact_url(url: str) -> str:
    """A store URL fit to print or log: the password, if any, replaced by ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
