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
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from convo.errors import ConfigError, SessionBusy, SessionNotFound, StoreError
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

    def lock(self, session_id: str, timeout_s: float = 60.0) -> AbstractContextManager[None]:
        """Hold ``session_id`` for one turn: other holders of the same store wait.

        The default is an in-process lock; :class:`SQLiteStore` locks a file and
        :class:`RedisStore` a key, so turns of one session never interleave across
        processes either.

        Args:
            session_id: the session (it need not exist yet).
            timeout_s: seconds to wait for another holder before :class:`StoreError`.
        """
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

    def append(
        self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None
    ) -> None:
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
                raise SessionNotFound(f"no session {session_id!r} in {self.path}")

    def list_sessions(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT id FROM sessions ORDER BY id")]

    @contextmanager
    def lock(self, session_id: str, timeout_s: float = 60.0) -> Iterator[None]:
        """Hold ``session_id`` across threads and processes (an ``flock`` on a file in
        ``<path>.locks/``; the OS drops it if the holder dies)."""
        import fcntl
        import hashlib

        folder = self.path + ".locks"
        os.makedirs(folder, exist_ok=True)
        name = hashlib.sha256(session_id.encode()).hexdigest()[:32]
        fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout_s
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
            yield
        finally:
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
_R_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
_R_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = tonumber(ARGV[1])
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[1 + i]) end
redis.call('HSET', KEYS[1], unpack(ARGV, n + 2))
return 1
"""
_R_SAVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
_R_SUMMARY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'summarized_turns') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'summary', ARGV[2], 'summarized_turns', ARGV[3], 'updated_at', ARGV[4])
return 1
"""
_R_DELETE = """
local n = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
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


class RedisStore(Store):
    """Sessions in Redis, shared by server replicas.

    Each append (messages + state) is one Lua script, so it is atomic; :meth:`lock` is a
    lease (``SET NX PX`` with a random token, renewed while held, released by a
    compare-and-delete script), so two replicas never interleave turns of one session.

    Args:
        url: e.g. ``"redis://127.0.0.1:6379/0"``.
        prefix: key prefix, so several apps (or tests) share one database. Default ``"convo:"``.
        lock_lease_s: how long a lock outlives a holder that died without releasing it.
            Renewed every third of it while held. Default 30 s.

    Example:
        >>> store = RedisStore("redis://127.0.0.1:6379/0")   # doctest: +SKIP
    """

    def __init__(self, url: str, *, prefix: str = "convo:", lock_lease_s: float = 30.0) -> None:
        try:
            import redis
        except ImportError:
            from convo.errors import MissingDependency

            raise MissingDependency("'redis' is not installed; run: pip install 'convo[server]'") from None
        if lock_lease_s <= 0:
            raise ConfigError("lock_lease_s must be > 0")
        self.url = url
        self.prefix = prefix
        self.lock_lease_s = lock_lease_s
        self._r = redis.Redis.from_url(url, decode_responses=True)
        try:
            self._r.ping()
        except redis.RedisError as exc:
            raise StoreError(f"cannot reach Redis at {url}: {exc}") from exc
        self._create = self._r.register_script(_R_CREATE)
        self._append = self._r.register_script(_R_APPEND)
        self._save = self._r.register_script(_R_SAVE)
        self._delete = self._r.register_script(_R_DELETE)
        self._summary = self._r.register_script(_R_SUMMARY)
        self._release = self._r.register_script(_R_RELEASE)
        self._renew = self._r.register_script(_R_RENEW)

    def _keys(self, session_id: str) -> tuple[str, str]:
        return f"{self.prefix}s:{session_id}", f"{self.prefix}m:{session_id}"

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

    def create(self, state: SessionState) -> None:
        now = time.time()
        state = replace(state, created_at=state.created_at or now, updated_at=now)
        skey, _ = self._keys(state.session_id)
        args = [state.session_id, *self._fields(state, created=True)]
        if not self._create(keys=[skey, f"{self.prefix}sessions"], args=args):
            raise StoreError(f"session {state.session_id!r} already exists")

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        skey, mkey = self._keys(session_id)
        pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC: one consistent snapshot
        pipe.hgetall(skey)
        pipe.lrange(mkey, 0, -1)
        row, records = pipe.execute()
        if not row:
            raise SessionNotFound(f"no session {session_id!r} in {self.url}")
        state = SessionState(
            session_id=session_id,
            settings=json.loads(row["settings"]),
            summary=row["summary"],
            summarized_turns=int(row["summarized_turns"]),
            evicted_turns=int(row["evicted_turns"]),
            owner=row["owner"],
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
        )
        return state, [Message.from_record(json.loads(r)) for r in records]

    def exists(self, session_id: str) -> bool:
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
        if not self._append(keys=[skey, mkey], args=[len(records), *records, *fields]):
            raise SessionNotFound(f"no session {session_id!r} in {self.url}")

    def save_state(self, state: SessionState) -> None:
        fields = self._fields(replace(state, updated_at=time.time()), created=False)
        if not self._save(keys=[self._keys(state.session_id)[0]], args=fields):
            raise SessionNotFound(f"no session {state.session_id!r} in {self.url}")

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
        if not self._delete(keys=[skey, mkey, f"{self.prefix}sessions"], args=[session_id]):
            raise SessionNotFound(f"no session {session_id!r} in {self.url}")

    def list_sessions(self) -> list[str]:
        return sorted(str(s) for s in self._r.smembers(f"{self.prefix}sessions"))

    @contextmanager
    def lock(self, session_id: str, timeout_s: float = 60.0) -> Iterator[None]:
        """Hold ``session_id`` across processes and hosts (a renewed Redis lease)."""
        import secrets

        key, token = f"{self.prefix}lock:{session_id}", secrets.token_hex(16)
        lease_ms = int(self.lock_lease_s * 1000)
        deadline = time.monotonic() + timeout_s
        while not self._r.set(key, token, nx=True, px=lease_ms):
            if time.monotonic() >= deadline:
                raise SessionBusy(
                    f"session {session_id!r} is busy with another turn (waited {timeout_s:.0f} s)"
                )
            time.sleep(0.01)
        done = threading.Event()

        def renew() -> None:  # keep the lease while a long turn runs
            while not done.wait(self.lock_lease_s / 3):
                self._renew(keys=[key], args=[token, lease_ms])

        keeper = threading.Thread(target=renew, name="convo-redis-lease", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            done.set()
            keeper.join()
            self._release(keys=[key], args=[token])

    def close(self) -> None:
        self._r.close()
