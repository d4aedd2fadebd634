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
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from convo.errors import ConfigError, SessionBusy, SessionLockLost, SessionNotFound, StoreError
from convo.messages import Message

logger = logging.getLogger(__name__)

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
    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        """Create a session with its first ``messages`` (e.g. the system prompt), in one
        transaction: a session is never seen half-made. Raises StoreError if the id exists."""

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

    def save_summary(
        self, session_id: str, *, summary: str, covered_from: int, summarized_turns: int
    ) -> bool:
        """Store a summary that folds turns ``[covered_from, summarized_turns)`` into the one
        that covered ``[0, covered_from)``, only if the stored state still says
        ``summarized_turns == covered_from`` (a compare-and-set: a late or repeated background
        job never overwrites a newer summary). Returns whether it was stored.

        The stores here do it atomically; this default (for other stores) reads and writes
        the state without a transaction.

        Raises:
            SessionNotFound: no such session.
        """
        state, _ = self.load(session_id)
        if state.summarized_turns != covered_from:
            return False
        self.save_state(replace(state, summary=summary, summarized_turns=summarized_turns))
        return True

    @abc.abstractmethod
    def delete(self, session_id: str) -> None:
        """Delete a session and its history. Raises SessionNotFound."""

    @abc.abstractmethod
    def list_sessions(self) -> list[str]:
        """All session ids."""

    def peek(self, session_id: str) -> tuple[SessionState, int]:
        """The state and the number of stored messages, without reading the messages
        (a session checks with it whether another process wrote since it last looked).
        Raises SessionNotFound."""
        state, messages = self.load(session_id)
        return state, len(messages)

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
        self.create(state, messages)
        return sid

    def lock(self, session_id: str, timeout_s: float = 60.0) -> AbstractContextManager[None]:
        """Hold ``session_id`` for one turn: other holders of the same store wait.

        The default is an in-process lock; :class:`SQLiteStore` locks a file and
        :class:`RedisStore` a key, so turns of one session never interleave across
        processes either. The lock is reentrant within a thread: a :class:`~convo.Session`
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

    def _held(self) -> dict[str, int]:
        with _LOCKS_GUARD:
            local: threading.local = self.__dict__.setdefault("_held_locks", threading.local())
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
        with self._acquire(session_id, timeout_s):
            held[session_id] = 1
            try:
                yield
            finally:
                del held[session_id]

    def _acquire(self, session_id: str, timeout_s: float) -> AbstractContextManager[None]:
        """Take the lock for a thread that does not hold it yet (stores override this)."""
        with _LOCKS_GUARD:
            locks: dict[str, threading.Lock] = self.__dict__.setdefault("_session_locks", {})
            held = locks.setdefault(session_id, threading.Lock())
        return _hold(held, session_id, timeout_s)

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections."""


_LOCKS_GUARD = threading.Lock()


@contextmanager
def _hold(lock: threading.Lock, session_id: str, timeout_s: float) -> Iterator[None]:
    if not lock.acquire(timeout=timeout_s):
        raise SessionBusy(f"session {session_id!r} is busy with another turn (waited {timeout_s:.0f} s)")
    try:
        yield
    finally:
        lock.release()


class MemoryStore(Store):
    """A store in a dict, for tests and throw-away sessions (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[SessionState, list[Message]]] = {}

    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        with self._lock:
            if state.session_id in self._data:
                raise StoreError(f"session {state.session_id!r} already exists")
            self._data[state.session_id] = (state, list(messages))

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
            return state, list(msgs)

    def exists(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._data

    def append(
        self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None
    ) -> None:
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

    def save_summary(
        self, session_id: str, *, summary: str, covered_from: int, summarized_turns: int
    ) -> bool:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
            if state.summarized_turns != covered_from:
                return False
            self._data[session_id] = (
                replace(state, summary=summary, summarized_turns=summarized_turns),
                msgs,
            )
            return True

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
        now = time.time()
        state = replace(state, created_at=state.created_at or now, updated_at=now)
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO sessions (settings, summary, summarized_turns, evicted_turns, owner,"
                    " updated_at, id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (*self._state_row(state), state.created_at),
                )
                db.executemany(
                    "INSERT INTO messages (session_id, seq, record) VALUES (?, ?, ?)",
                    [(state.session_id, i, json.dumps(m.to_record())) for i, m in enumerate(messages)],
                )
        except sqlite3.IntegrityError:
            raise StoreError(f"session {state.session_id!r} already exists") from None

    def peek(self, session_id: str) -> tuple[SessionState, int]:
        db = self._conn()
        state = self._state_of(db, session_id)
        row = db.execute("SELECT COUNT(*) FROM messages WHERE session_id = ?", (session_id,)).fetchone()
        return state, int(row[0])

    def _state_of(self, db: sqlite3.Connection, session_id: str) -> SessionState:
        row = db.execute(
            "SELECT settings, summary, summarized_turns, evicted_turns, owner, created_at,"
            " updated_at FROM sessions WHERE id = ?",
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
        )

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        db = self._conn()
        state = self._state_of(db, session_id)
        records = db.execute(
            "SELECT record FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
        return state, [Message.from_record(json.loads(r[0])) for r in records]

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

    def save_state(self, state: SessionState) -> None:
        with self._tx() as db:
            self._update_state(db, state)

    def save_summary(
        self, session_id: str, *, summary: str, covered_from: int, summarized_turns: int
    ) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE sessions SET summary = ?, summarized_turns = ?, updated_at = ?"
                " WHERE id = ? AND summarized_turns = ?",
                (summary, summarized_turns, time.time(), session_id, covered_from),
            )
            if cur.rowcount == 0 and not self._exists_in(db, session_id):
                raise SessionNotFound(f"no session {session_id!r} in {self.path}")
            return cur.rowcount > 0

    def delete(self, session_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
            cur = db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            if cur.rowcount == 0:
                raise SessionNotFound(f"no session {session_id!r}")

    def list_sessions(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT id FROM sessions ORDER BY id")]

    @contextmanager
    def _acquire(self, session_id: str, timeout_s: float) -> Iterator[None]:
        """Hold ``session_id`` across threads and processes: an ``flock`` on a file in
        ``<path>.locks/`` (the OS drops it if the holder dies).

        The holder removes the file before it lets go, so locks of deleted or never-made
        sessions leave nothing behind. A waiter that then wins the lock on the removed
        file sees that the path no longer names it, and starts again on the new file.
        """
        import fcntl
        import hashlib

        folder = self.path + ".locks"
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, hashlib.sha256(session_id.encode()).hexdigest()[:32])
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
                mine = os.fstat(fd)
                try:
                    now = os.stat(path)
                    current = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
                except FileNotFoundError:
                    current = False
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


# Redis layout, under ``prefix`` (default ``convo:``):
#   {p}s:{id}     hash   state fields (settings as JSON)
#   {p}m:{id}     list   message records (JSON), in order
#   {p}sessions   set    every session id
#   {p}lock:{id}  string the turn lock's token (SET NX PX, renewed while held)
# Writes made under the lock carry its token ("fence"); the script refuses them (-1) when
# the lock key no longer holds that token, i.e. the lease expired and may be someone else's.
# Every fenced script starts with that check (ARGV[1]: the token, '' for an unfenced write;
# the last key: the lock key); those that write into a session then refuse (0) a missing one.
_R_FENCE = "if ARGV[1] ~= '' and redis.call('GET', KEYS[#KEYS]) ~= ARGV[1] then return -1 end"
_R_EXISTING = f"""{_R_FENCE}
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end"""
_R_CREATE = f"""
{_R_FENCE}
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = tonumber(ARGV[3])
for i = 1, n do redis.call('RPUSH', KEYS[3], ARGV[3 + i]) end
redis.call('HSET', KEYS[1], unpack(ARGV, n + 4))
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""
_R_APPEND = f"""
{_R_EXISTING}
local n = tonumber(ARGV[2])
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[2 + i]) end
redis.call('HSET', KEYS[1], unpack(ARGV, n + 3))
return 1
"""
_R_SAVE = f"""
{_R_EXISTING}
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""
_R_SUMMARY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'summarized_turns') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'summary', ARGV[2], 'summarized_turns', ARGV[3], 'updated_at', ARGV[4])
return 1
"""
_R_DELETE = f"""
{_R_FENCE}
local n = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
return n
"""
_R_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_R_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def redact_url(url: str) -> str:
    """A store URL fit to print or log: the password, if any, replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore(Store):
    """Sessions in Redis, shared by server replicas.

    Each append (messages + state) is one Lua script, so it is atomic; :meth:`lock` is a
    lease (``SET NX PX`` with a random token, renewed while held, released by a
    compare-and-delete script), so two replicas never interleave turns of one session.
    Writes made while holding the lease are fenced with its token: if the lease expired
    (Redis unreachable for longer than ``lock_lease_s``) the write is refused with
    :class:`~convo.errors.SessionLockLost` instead of landing after another turn's.

    Args:
        url: e.g. ``"redis://127.0.0.1:6379/0"``.
        prefix: key prefix, so several apps (or tests) share one database. Default ``"convo:"``.
        lock_lease_s: how long a lock outlives a holder that died without releasing it.
            Renewed every third of it while held. Default 30 s.
        socket_timeout_s: how long one Redis call may wait for an answer before it fails
            with :class:`~convo.errors.StoreError` (a stopped Redis does not hang a turn
            forever). Default 10 s.

    Example:
        >>> store = RedisStore("redis://127.0.0.1:6379/0")   # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "convo:",
        lock_lease_s: float = 30.0,
        socket_timeout_s: float = 10.0,
    ) -> None:
        try:
            import redis
        except ImportError:
            from convo.errors import MissingDependency

            raise MissingDependency("'redis' is not installed; run: pip install 'convo[server]'") from None
        if not lock_lease_s > 0:
            raise ConfigError("lock_lease_s must be > 0")
        if not socket_timeout_s > 0:
            raise ConfigError("socket_timeout_s must be > 0")
        self.url = url
        self.prefix = prefix
        self.lock_lease_s = lock_lease_s
        self.socket_timeout_s = socket_timeout_s
        self._redis_error = redis.RedisError
        self._r = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
        )
        self._tokens = threading.local()  # session id -> this thread's lease token
        with self._errors():
            self._r.ping()
        self._create = self._r.register_script(_R_CREATE)
        self._append = self._r.register_script(_R_APPEND)
        self._save = self._r.register_script(_R_SAVE)
        self._delete = self._r.register_script(_R_DELETE)
        self._summary = self._r.register_script(_R_SUMMARY)
        self._release = self._r.register_script(_R_RELEASE)
        self._renew = self._r.register_script(_R_RENEW)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Redis client errors become StoreError (no URL or password in the message)."""
        try:
            yield
        except self._redis_error as exc:
            logger.warning("Redis at %s failed: %s", redact_url(self.url), exc)
            raise StoreError(
                f"the session store (Redis) is unreachable or failed: {type(exc).__name__}"
            ) from None

    def ping(self) -> None:
        """Raise :class:`~convo.errors.StoreError` unless Redis answers."""
        with self._errors():
            self._r.ping()

    def _keys(self, session_id: str) -> tuple[str, str]:
        return f"{self.prefix}s:{session_id}", f"{self.prefix}m:{session_id}"

    def _fence(self, session_id: str) -> tuple[str, str]:
        """The lock key and this thread's lease token for it ('' when not held)."""
        tokens: dict[str, str] = getattr(self._tokens, "by_session", {})
        return f"{self.prefix}lock:{session_id}", tokens.get(session_id, "")

    def _run(self, script: Any, session_id: str, keys: list[str], args: list[Any]) -> int:
        lock_key, token = self._fence(session_id)
        with self._errors():
            result = int(script(keys=[*keys, lock_key], args=[token, *args]))
        if result == -1:
            raise SessionLockLost(
                f"the lock on session {session_id!r} expired while this turn ran (Redis was "
                "unreachable past the lease); nothing was stored, run the turn again"
            )
        return result

    @staticmethod
    def _fields(state: SessionState, *, created: bool) -> list[Any]:
        """HSET arguments; ``created_at`` only when creating (it never changes)."""
        fields = [
            "settings", json.dumps(dict(state.settings)),
            "summary", state.summary,
            "summarized_turns", state.summarized_turns,
            "evicted_turns", state.evicted_turns,
            "owner", state.owner,
            "updated_at", repr(state.updated_at or time.time()),
        ]  # fmt: skip
        return [*fields, "created_at", repr(state.created_at)] if created else fields

    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        now = time.time()
        state = replace(state, created_at=state.created_at or now, updated_at=now)
        skey, mkey = self._keys(state.session_id)
        records = [json.dumps(m.to_record()) for m in messages]
        args = [state.session_id, len(records), *records, *self._fields(state, created=True)]
        if not self._run(self._create, state.session_id, [skey, f"{self.prefix}sessions", mkey], args):
            raise StoreError(f"session {state.session_id!r} already exists")

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        skey, mkey = self._keys(session_id)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC: one consistent snapshot
            pipe.hgetall(skey)
            pipe.lrange(mkey, 0, -1)
            row, records = pipe.execute()
        state = self._state_of(session_id, row)
        return state, [Message.from_record(json.loads(r)) for r in records]

    def peek(self, session_id: str) -> tuple[SessionState, int]:
        skey, mkey = self._keys(session_id)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)
            pipe.hgetall(skey)
            pipe.llen(mkey)
            row, count = pipe.execute()
        return self._state_of(session_id, row), int(count)

    def _state_of(self, session_id: str, row: Mapping[str, str]) -> SessionState:
        if not row:
            raise SessionNotFound(f"no session {session_id!r}")
        return SessionState(
            session_id=session_id,
            settings=json.loads(row["settings"]),
            summary=row["summary"],
            summarized_turns=int(row["summarized_turns"]),
            evicted_turns=int(row["evicted_turns"]),
            owner=row["owner"],
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
        )

    def exists(self, session_id: str) -> bool:
        with self._errors():
            return bool(self._r.exists(self._keys(session_id)[0]))

    def append(
        self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None
    ) -> None:
        skey, mkey = self._keys(session_id)
        records = [json.dumps(m.to_record()) for m in messages]
        if state is not None:
            if state.session_id != session_id:
                raise StoreError(f"state of {state.session_id!r} appended to {session_id!r}")
            fields = self._fields(replace(state, updated_at=time.time()), created=False)
        else:
            fields = ["updated_at", repr(time.time())]
        if not self._run(self._append, session_id, [skey, mkey], [len(records), *records, *fields]):
            raise SessionNotFound(f"no session {session_id!r}")

    def save_state(self, state: SessionState) -> None:
        fields = self._fields(replace(state, updated_at=time.time()), created=False)
        if not self._run(self._save, state.session_id, [self._keys(state.session_id)[0]], fields):
            raise SessionNotFound(f"no session {state.session_id!r}")

    def save_summary(
        self, session_id: str, *, summary: str, covered_from: int, summarized_turns: int
    ) -> bool:
        args: list[str | int] = [str(covered_from), summary, summarized_turns, repr(time.time())]
        done = int(self._summary(keys=[self._keys(session_id)[0]], args=args))
        if done < 0:
            raise SessionNotFound(f"no session {session_id!r} in {self.url}")
        return done == 1

    def delete(self, session_id: str) -> None:
        skey, mkey = self._keys(session_id)
        if not self._run(self._delete, session_id, [skey, mkey, f"{self.prefix}sessions"], [session_id]):
            raise SessionNotFound(f"no session {session_id!r}")

    def list_sessions(self) -> list[str]:
        with self._errors():
            return sorted(str(s) for s in self._r.smembers(f"{self.prefix}sessions"))

    @contextmanager
    def _acquire(self, session_id: str, timeout_s: float) -> Iterator[None]:
        """Hold ``session_id`` across processes and hosts (a renewed Redis lease).

        A thread renews the lease every third of ``lock_lease_s``. A failed renewal (Redis
        timed out or restarted) is logged and retried on the next beat; the thread only
        stops when the turn ends. If the lease expired meanwhile, the turn's writes are
        refused by the fence (see :meth:`_run`).
        """
        import secrets

        key, token = f"{self.prefix}lock:{session_id}", secrets.token_hex(16)
        lease_ms = int(self.lock_lease_s * 1000)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._errors():
                if self._r.set(key, token, nx=True, px=lease_ms):
                    break
            if time.monotonic() >= deadline:
                raise SessionBusy(
                    f"session {session_id!r} is busy with another turn (waited {timeout_s:.0f} s)"
                )
            time.sleep(0.01)
        done = threading.Event()

        def renew() -> None:  # keep the lease while a long turn runs
            while not done.wait(self.lock_lease_s / 3):
                try:
                    if not self._renew(keys=[key], args=[token, lease_ms]):
                        logger.warning("the lock on session %r expired while held", session_id)
                except Exception as exc:  # keep renewing: the next beat may reach Redis
                    logger.warning("could not renew the lock on session %r: %s", session_id, exc)

        keeper = threading.Thread(target=renew, name="convo-redis-lease", daemon=True)
        keeper.start()
        tokens: dict[str, str] = self._tokens.__dict__.setdefault("by_session", {})
        tokens[session_id] = token
        try:
            yield
        finally:
            tokens.pop(session_id, None)
            done.set()
            keeper.join()
            try:
                self._release(keys=[key], args=[token])
            except self._redis_error as exc:  # the lease expires on its own
                logger.warning("could not release the lock on session %r: %s", session_id, exc)

    def close(self) -> None:
        self._r.close()
