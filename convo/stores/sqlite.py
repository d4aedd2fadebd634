"""The embedded default store: one SQLite file shared by threads and processes.

WAL journal, a busy timeout, one connection per thread, ``BEGIN IMMEDIATE`` writes, so
sessions in many threads and processes share one file without "database is locked". A
turn's lock is an ``flock`` on a file in ``<path>.locks/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from convo.errors import ConfigError, SessionBusy, SessionNotFound, StoreError
from convo.messages import Message
from convo.stores.base import (
    FORK_SEPARATOR,
    MemoryLog,
    SessionState,
    Store,
    StoredTail,
    is_fork_of,
    new_epoch,
)

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    settings TEXT NOT NULL,
    summary TEXT NOT NULL DEFAULT '',
    summarized_turns INTEGER NOT NULL DEFAULT 0,
    evicted_turns INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    epoch TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS memory (
    scope TEXT NOT NULL,
    seq INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (scope, seq)
);
CREATE INDEX IF NOT EXISTS memory_by_session ON memory (session_id);
"""


class SQLiteStore(Store):
    """A SQLite file shared by threads and processes.

    Args:
        path: the database file (created with its folder). ``":memory:"`` is refused
            because each thread would see a different database; use InMemoryStore.
        busy_timeout_s: how long a writer waits for another's lock before failing.
            Default 30 s.

    Example:
        >>> store = SQLiteStore("/tmp/convo-example.db")   # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float = 30.0) -> None:
        if str(path) == ":memory:":
            raise ConfigError("SQLiteStore needs a file; use InMemoryStore for an in-memory store")
        if busy_timeout_s <= 0:
            raise ConfigError("busy_timeout_s must be > 0")
        self.path = os.fspath(path)
        self.busy_timeout_s = busy_timeout_s
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        self._local = threading.local()
        self._conn().executescript(_SCHEMA)  # executescript manages its own transaction
        self._migrate()
        remove_stale_lock_files(self.locks_folder)

    def _migrate(self) -> None:
        """Bring a file written by an older convo up to this schema: ``epoch`` was added
        (old sessions get ``''``, :data:`~convo.stores.base.LEGACY_EPOCH`)."""
        db = self._conn()
        columns = {row[1] for row in db.execute("PRAGMA table_info(sessions)")}
        if "epoch" in columns:
            return
        try:
            with self._tx() as tx:
                tx.execute("ALTER TABLE sessions ADD COLUMN epoch TEXT NOT NULL DEFAULT ''")
        except sqlite3.OperationalError as exc:  # another process added it meanwhile
            if "duplicate column" not in str(exc):
                raise

    @property
    def locks_folder(self) -> str:
        """The folder of the turn locks' files: ``<path>.locks``."""
        return self.path + ".locks"

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            self._use_wal(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        """Put the file in WAL mode (it stays so: the mode is kept in the file).

        Switching the journal mode does not wait on SQLite's busy handler: when another
        process is creating the same new file it fails at once with "database is locked".
        So it is retried here, within ``busy_timeout_s``."""
        deadline = time.monotonic() + self.busy_timeout_s
        pause = 0.005
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"cannot open {self.path} in WAL mode within {self.busy_timeout_s} s: {exc}"
                    ) from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.1)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        db = self._conn()
        try:
            # IMMEDIATE takes the write lock up front: no deadlock-prone lock upgrades.
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot start a SQLite transaction: {exc}") from exc
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

    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        try:
            self._insert(state, messages, if_missing=False)
        except sqlite3.IntegrityError:
            raise StoreError(f"session {state.session_id!r} already exists") from None

    def create_if_missing(self, state: SessionState, messages: Sequence[Message] = ()) -> bool:
        return self._insert(state, messages, if_missing=True)

    def _insert(self, state: SessionState, messages: Sequence[Message], *, if_missing: bool) -> bool:
        """Insert the session and its messages in one write transaction; with ``if_missing``
        an existing id is left as it is (``False``) instead of an IntegrityError."""
        now = time.time()
        state = replace(state, created_at=state.created_at or now, updated_at=now)
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO sessions (settings, summary, summarized_turns, evicted_turns, owner,"
                " updated_at, id, created_at, epoch) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                + (" ON CONFLICT (id) DO NOTHING" if if_missing else ""),
                (*self._state_row(state), state.created_at, new_epoch()),
            )
            if cur.rowcount == 0:
                return False
            db.executemany(
                "INSERT INTO messages (session_id, seq, record) VALUES (?, ?, ?)",
                [(state.session_id, i, json.dumps(m.to_record())) for i, m in enumerate(messages)],
            )
        return True

    def peek(self, session_id: str) -> tuple[SessionState, int]:
        db = self._conn()
        state = self._state_of(db, session_id)
        # Positions run 0..n-1 (append-only), so the count is the last one + 1: a key lookup.
        row = db.execute("SELECT MAX(seq) FROM messages WHERE session_id = ?", (session_id,)).fetchone()
        return state, 0 if row[0] is None else int(row[0]) + 1

    def _state_of(self, db: sqlite3.Connection, session_id: str) -> SessionState:
        row = db.execute(
            "SELECT settings, summary, summarized_turns, evicted_turns, owner, created_at,"
            " updated_at, epoch FROM sessions WHERE id = ?",
            (session_id,),
        ).fetchone()
        if row is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return SessionState(
            session_id=session_id,
            settings=json.loads(row[0]),
            summary=row[1],
            summarized_turns=row[2],
            evicted_turns=row[3],
            owner=row[4],
            created_at=row[5],
            updated_at=row[6],
            epoch=row[7],
        )

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        db = self._conn()
        state = self._state_of(db, session_id)
        records = db.execute(
            "SELECT record FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
        return state, self._stitched(state, [Message.from_record(json.loads(r[0])) for r in records])

    def load_tail(self, session_id: str, after: int) -> StoredTail:
        """See :meth:`Store.load_tail`: one read transaction; the count is the last
        position + 1 and the tail a range of the ``(session_id, seq)`` key, so the cost
        follows the tail, not the history."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        db = self._conn()
        db.execute("BEGIN")  # deferred: a read snapshot (WAL), no write lock
        try:
            state = self._state_of(db, session_id)
            last = db.execute("SELECT MAX(seq) FROM messages WHERE session_id = ?", (session_id,)).fetchone()
            records = db.execute(
                "SELECT record FROM messages WHERE session_id = ? AND seq >= ? ORDER BY seq",
                (session_id, after),
            ).fetchall()
        finally:
            db.execute("COMMIT")
        count = 0 if last[0] is None else int(last[0]) + 1
        return StoredTail(
            state=state,
            count=count,
            after=after,
            messages=[Message.from_record(json.loads(r[0])) for r in records],
        )

    def exists(self, session_id: str) -> bool:
        row = self._conn().execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def append(
        self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None
    ) -> None:
        with self._tx() as db:
            row = db.execute(
                "SELECT COALESCE(MAX(seq), -1) FROM messages WHERE session_id = ?", (session_id,)
            ).fetchone()
            if not self._exists_in(db, session_id):
                raise SessionNotFound(f"no session {session_id!r}")
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
            raise SessionNotFound(f"no session {state.session_id!r}")

    def truncate(self, session_id: str, keep: int, *, state: SessionState | None = None) -> None:
        with self._tx() as db:
            if not self._exists_in(db, session_id):
                raise SessionNotFound(f"no session {session_id!r}")
            db.execute(
                "DELETE FROM messages WHERE session_id = ? AND seq NOT IN"
                " (SELECT seq FROM messages WHERE session_id = ? ORDER BY seq LIMIT ?)",
                (session_id, session_id, max(keep, 0)),
            )
            db.execute("UPDATE sessions SET epoch = ? WHERE id = ?", (new_epoch(), session_id))
            if state is not None:
                self._update_state(db, state)
            else:
                db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (time.time(), session_id))

    def save_state(self, state: SessionState) -> None:
        with self._tx() as db:
            self._update_state(db, state)

    def save_summary(
        self,
        session_id: str,
        *,
        summary: str,
        covered_from: int,
        summarized_turns: int,
        epoch: str | None = None,
    ) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE sessions SET summary = ?, summarized_turns = ?, updated_at = ?"
                " WHERE id = ? AND summarized_turns = ? AND (? IS NULL OR epoch = ?)",
                (summary, summarized_turns, time.time(), session_id, covered_from, epoch, epoch),
            )
            if cur.rowcount == 0 and not self._exists_in(db, session_id):
                raise SessionNotFound(f"no session {session_id!r} in {self.path}")
            return cur.rowcount > 0

    def delete(self, session_id: str, *, forks: bool = False) -> None:
        with self._tx() as db:
            doomed = [session_id, *(self._forks_in(db, session_id) if forks else [])]
            for sid in doomed:
                db.execute("DELETE FROM messages WHERE session_id = ?", (sid,))
                # Its retrieval memory, in its own scope and in any person's it wrote to.
                db.execute("DELETE FROM memory WHERE session_id = ?", (sid,))
            cur = db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            if cur.rowcount == 0:
                raise SessionNotFound(f"no session {session_id!r}")
            db.executemany("DELETE FROM sessions WHERE id = ?", [(sid,) for sid in doomed[1:]])

    def forks_of(self, session_id: str) -> list[str]:
        return self._forks_in(self._conn(), session_id)

    # -- retrieval memory (see Store.append_memory) ---------------------------------------
    memory_persisted = True

    def append_memory(
        self,
        scope: str,
        records: Sequence[Mapping[str, Any]],
        *,
        session_id: str | None,
        epoch: str | None = None,
    ) -> bool:
        """See :meth:`Store.append_memory`: one write transaction that checks the
        session's epoch and appends the rows (a ``kill -9`` leaves all or none)."""
        with self._tx() as db:
            if session_id is not None:
                row = db.execute("SELECT epoch FROM sessions WHERE id = ?", (session_id,)).fetchone()
                if row is None or (epoch is not None and row[0] != epoch):
                    return False
            last = db.execute(
                "SELECT COALESCE(MAX(seq), -1) FROM memory WHERE scope = ?", (scope,)
            ).fetchone()
            db.executemany(
                "INSERT INTO memory (scope, seq, session_id, record) VALUES (?, ?, ?, ?)",
                [
                    (scope, last[0] + 1 + i, session_id or "", json.dumps(dict(r)))
                    for i, r in enumerate(records)
                ],
            )
        return True

    def memory_log(self, scope: str, after: int = 0) -> MemoryLog:
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        db = self._conn()
        db.execute("BEGIN")  # one read snapshot
        try:
            count = db.execute("SELECT COUNT(*) FROM memory WHERE scope = ?", (scope,)).fetchone()[0]
            rows = db.execute(
                "SELECT record FROM memory WHERE scope = ? ORDER BY seq LIMIT -1 OFFSET ?", (scope, after)
            ).fetchall()
        finally:
            db.execute("COMMIT")
        return MemoryLog(scope=scope, count=int(count), after=after, records=[json.loads(r[0]) for r in rows])

    def memory_counts(self, scopes: Sequence[str]) -> dict[str, int]:
        db = self._conn()
        out = dict.fromkeys(scopes, 0)
        for scope in out:
            row = db.execute("SELECT COUNT(*) FROM memory WHERE scope = ?", (scope,)).fetchone()
            out[scope] = int(row[0])
        return out

    def delete_memory(self, scope: str) -> int:
        with self._tx() as db:
            return int(db.execute("DELETE FROM memory WHERE scope = ?", (scope,)).rowcount)

    def _forks_in(self, db: sqlite3.Connection, session_id: str) -> list[str]:
        """The forks of ``session_id`` (see :meth:`Store.forks_of`): an index range scan
        of the ids that start with ``<id>~``. Raises SessionNotFound."""
        owner = self._state_of(db, session_id).owner
        low = session_id + FORK_SEPARATOR
        high = low[:-1] + chr(ord(FORK_SEPARATOR) + 1)  # every id with the prefix sorts below
        rows = db.execute(
            "SELECT id FROM sessions WHERE id >= ? AND id < ? AND owner = ? ORDER BY id", (low, high, owner)
        ).fetchall()
        return [r[0] for r in rows if is_fork_of(r[0], session_id)]

    def list_sessions(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT id FROM sessions ORDER BY id")]

    @contextmanager
    def _acquire(self, session_id: str, timeout_s: float) -> Iterator[None]:
        """Hold ``session_id`` across threads and processes: an ``flock`` on a file in
        ``<path>.locks/`` (the OS drops it if the holder dies).

        The holder removes the file before it lets go, so locks of deleted or never-made
        sessions leave nothing behind. A waiter that then wins the lock on the removed
        file sees that the path no longer names it, and starts again on the new file. A
        holder killed before it could remove its file leaves it; the next open of the
        store removes it (see :func:`remove_stale_lock_files`).
        """
        import fcntl  # POSIX only: imported where a lock is taken

        os.makedirs(self.locks_folder, exist_ok=True)
        path = os.path.join(self.locks_folder, _lock_file_name(session_id))
        deadline = time.monotonic() + timeout_s
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise SessionBusy(
                                f"session {session_id!r} is busy with another turn (waited {timeout_s:.0f} s)"
                            ) from None
                        time.sleep(0.01)
                current = _names(path, fd)
            except BaseException:
                os.close(fd)
                raise
            if current:
                break
            os.close(fd)  # we locked a file its last holder removed: take the new one
        try:
            yield
        finally:
            try:
                os.unlink(path)  # still holding: waiters on this file will start again
            except FileNotFoundError:
                pass
            os.close(fd)  # closing the descriptor drops the lock

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


#: Hex characters of a session id's hash that name its lock file.
_LOCK_NAME_CHARS = 32


def _lock_file_name(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()[:_LOCK_NAME_CHARS]


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    mine = os.fstat(fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def remove_stale_lock_files(folder: str) -> int:
    """Remove the lock files in ``folder`` that no live process holds; returns how many.

    A holder killed with SIGKILL (or a crash) cannot remove its file; the OS drops its
    ``flock`` though. So a file whose lock can be taken without waiting has no holder:
    it is taken, removed while held, and let go, exactly as a holder lets go, so a
    process waiting on it at that moment sees the path no longer names it and starts
    again on a new file. A file whose lock is held (a live holder) is left alone.
    :class:`SQLiteStore` calls this when it opens.
    """
    import fcntl  # POSIX only, as the locks are

    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names:
        if len(name) != _LOCK_NAME_CHARS or not all(c in "0123456789abcdef" for c in name):
            continue  # not a lock file of ours
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # removed meanwhile by its holder, or not a file
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live holder
            if _names(path, fd):
                os.unlink(path)
                removed += 1
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d lock file(s) left by killed holders in %s", removed, folder)
    return removed
