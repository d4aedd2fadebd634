"""Session stores: where the full history, the summary and the settings live.

The store keeps *everything*: every message ever sent, even those the prompt no longer
shows. A session's state is small and append-only, so each turn is one transaction.

:class:`SQLiteStore` is the embedded default: WAL journal, a busy timeout, one connection
per thread, ``BEGIN IMMEDIATE`` writes, so sessions in many threads and processes share
one file without "database is locked". :class:`MemoryStore` keeps state in a dict (tests,
throw-away sessions).
"""

from __future__ import annotations

import abc
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from convo.errors import ConfigError, SessionNotFound, StoreError
from convo.messages import Message

#: Version of the export format written by :meth:`Store.export_session`.
EXPORT_FORMAT = "convo.session/1"


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
    """

    session_id: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""
    summarized_turns: int = 0
    evicted_turns: int = 0
    owner: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0


class Store(abc.ABC):
    """The interface every store implements (SQLite, in-memory, Redis...)."""

    @abc.abstractmethod
    def create(self, state: SessionState) -> None:
        """Create a session. Raises StoreError if the id exists."""

    @abc.abstractmethod
    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        """State and full history. Raises SessionNotFound."""

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

    @abc.abstractmethod
    def delete(self, session_id: str) -> None:
        """Delete a session and its history. Raises SessionNotFound."""

    @abc.abstractmethod
    def list_sessions(self) -> list[str]:
        """All session ids."""

    def export_session(self, session_id: str) -> dict[str, Any]:
        """A JSON-safe dict with the whole session (state and every message)."""
        state, messages = self.load(session_id)
        return {
            "format": EXPORT_FORMAT,
            "session_id": state.session_id,
            "settings": dict(state.settings),
            "summary": state.summary,
            "summarized_turns": state.summarized_turns,
            "evicted_turns": state.evicted_turns,
            "owner": state.owner,
            "created_at": state.created_at,
            "updated_at": state.updated_at,
            "messages": [m.to_record() for m in messages],
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
        self.create(state)
        self.append(sid, messages)
        return sid

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections."""


class MemoryStore(Store):
    """A store in a dict, for tests and throw-away sessions (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[SessionState, list[Message]]] = {}

    def create(self, state: SessionState) -> None:
        with self._lock:
            if state.session_id in self._data:
                raise StoreError(f"session {state.session_id!r} already exists")
            self._data[state.session_id] = (state, [])

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
            return state, list(msgs)

    def exists(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._data

    def append(self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None) -> None:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            old, msgs = self._data[session_id]
            msgs.extend(messages)
            self._data[session_id] = (state or old, msgs)

    def save_state(self, state: SessionState) -> None:
        with self._lock:
            if state.session_id not in self._data:
                raise SessionNotFound(f"no session {state.session_id!r}")
            self._data[state.session_id] = (state, self._data[state.session_id][1])

    def delete(self, session_id: str) -> None:
        with self._lock:
            if self._data.pop(session_id, None) is None:
                raise SessionNotFound(f"no session {session_id!r}")

    def list_sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._data)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    settings TEXT NOT NULL,
    summary TEXT NOT NULL DEFAULT '',
    summarized_turns INTEGER NOT NULL DEFAULT 0,
    evicted_turns INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
"""


class SQLiteStore(Store):
    """A SQLite file shared by threads and processes.

    Args:
        path: the database file (created with its folder). ``":memory:"`` is refused
            because each thread would see a different database; use MemoryStore.
        busy_timeout_s: how long a writer waits for another's lock before failing.
            Default 30 s.

    Example:
        >>> store = SQLiteStore("/tmp/convo-example.db")   # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float = 30.0) -> None:
        if str(path) == ":memory:":
            raise ConfigError("SQLiteStore needs a file; use MemoryStore for an in-memory store")
        if busy_timeout_s <= 0:
            raise ConfigError("busy_timeout_s must be > 0")
        self.path = os.fspath(path)
        self.busy_timeout_s = busy_timeout_s
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        self._local = threading.local()
        self._conn().executescript(_SCHEMA)  # executescript manages its own transaction

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        db = self._conn()
        try:
            # IMMEDIATE takes the write lock up front: no deadlock-prone lock upgrades.
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot start a transaction on {self.path}: {exc}") from exc
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")

    @staticmethod
    def _state_row(state: SessionState) -> tuple[Any, ...]:
        return (
            json.dumps(dict(state.settings)),
            state.summary,
            state.summarized_turns,
            state.evicted_turns,
            state.owner,
            state.updated_at or time.time(),
            state.session_id,
        )

    def create(self, state: SessionState) -> None:
        now = time.time()
        state = replace(state, created_at=state.created_at or now, updated_at=now)
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO sessions (settings, summary, summarized_turns, evicted_turns, owner,"
                    " updated_at, id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (*self._state_row(state), state.created_at),
                )
        except sqlite3.IntegrityError:
            raise StoreError(f"session {state.session_id!r} already exists") from None

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        db = self._conn()
        row = db.execute(
            "SELECT settings, summary, summarized_turns, evicted_turns, owner, created_at,"
            " updated_at FROM sessions WHERE id = ?",
            (session_id,),
        ).fetchone()
        if row is None:
            raise SessionNotFound(f"no session {session_id!r} in {self.path}")
        state = SessionState(
            session_id=session_id,
            settings=json.loads(row[0]),
            summary=row[1],
            summarized_turns=row[2],
            evicted_turns=row[3],
            owner=row[4],
            created_at=row[5],
            updated_at=row[6],
        )
        records = db.execute(
            "SELECT record FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
        return state, [Message.from_record(json.loads(r[0])) for r in records]

    def exists(self, session_id: str) -> bool:
        row = self._conn().execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def append(self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None) -> None:
        with self._tx() as db:
            row = db.execute(
                "SELECT COALESCE(MAX(seq), -1) FROM messages WHERE session_id = ?", (session_id,)
            ).fetchone()
            if not self._exists_in(db, session_id):
                raise SessionNotFound(f"no session {session_id!r} in {self.path}")
            seq = row[0] + 1
            db.executemany(
                "INSERT INTO messages (session_id, seq, record) VALUES (?, ?, ?)",
                [(session_id, seq + i, json.dumps(m.to_record())) for i, m in enumerate(messages)],
            )
            if state is not None:
                self._update_state(db, state)
            else:
                db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (time.time(), session_id))

    @staticmethod
    def _exists_in(db: sqlite3.Connection, session_id: str) -> bool:
        return db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is not None

    def _update_state(self, db: sqlite3.Connection, state: SessionState) -> None:
        state = replace(state, updated_at=time.time())
        cur = db.execute(
            "UPDATE sessions SET settings = ?, summary = ?, summarized_turns = ?, evicted_turns = ?,"
            " owner = ?, updated_at = ? WHERE id = ?",
            self._state_row(state),
        )
        if cur.rowcount == 0:
            raise SessionNotFound(f"no session {state.session_id!r} in {self.path}")

    def save_state(self, state: SessionState) -> None:
        with self._tx() as db:
            self._update_state(db, state)

    def delete(self, session_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
            cur = db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            if cur.rowcount == 0:
                raise SessionNotFound(f"no session {session_id!r} in {self.path}")

    def list_sessions(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT id FROM sessions ORDER BY id")]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
