"""Sessions in Redis, shared by server replicas (needs the ``redis`` package:
``pip install 'convo[server]'``, imported when a :class:`RedisStore` is made)."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from convo.errors import (
    ConfigError,
    MissingDependency,
    SessionBusy,
    SessionLockLost,
    SessionNotFound,
    StoreError,
)
from convo.messages import Message
from convo.stores.base import (
    FORK_SEPARATOR,
    MemoryLog,
    SessionState,
    Store,
    StoredTail,
    is_fork_of,
    new_epoch,
    redact_url,
)

logger = logging.getLogger(__name__)


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
_R_TRUNCATE = f"""
{_R_EXISTING}
local keep = tonumber(ARGV[2])
if keep > 0 then redis.call('LTRIM', KEYS[2], 0, keep - 1) else redis.call('DEL', KEYS[2]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
return 1
"""
_R_SUMMARY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'summarized_turns') ~= ARGV[1] then return 0 end
if ARGV[5] == '1' and (redis.call('HGET', KEYS[1], 'epoch') or '') ~= ARGV[6] then return 0 end
redis.call('HSET', KEYS[1], 'summary', ARGV[2], 'summarized_turns', ARGV[3], 'updated_at', ARGV[4])
return 1
"""
# KEYS: the session's state and messages, the set of ids, then (state, messages) of each
# fork to delete with it, then the lock key; ARGV: token, the id, then each fork's id.
_R_DELETE = f"""
{_R_FENCE}
local n = redis.call('DEL', KEYS[1])
if n == 0 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
for i = 3, #ARGV do
  redis.call('DEL', KEYS[2 * i - 2], KEYS[2 * i - 1])
  redis.call('SREM', KEYS[3], ARGV[i])
end
return n
"""
# Retrieval memory: {p}mem:{scope} is a list of "<session id>\n<record JSON>" entries;
# {p}mscopes:{id} the set of scopes session {id} wrote to. KEYS: the session's state, the
# scope's list, the session's set of scopes, the lock key; ARGV: token, fenced by epoch
# ('1'/'0'), the epoch, the scope, n, then the n entries.
_R_MEMORY_APPEND = f"""
{_R_FENCE}
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] == '1' and (redis.call('HGET', KEYS[1], 'epoch') or '') ~= ARGV[3] then return 0 end
local n = tonumber(ARGV[5])
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[5 + i]) end
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""
# Drop what sessions wrote, in every scope they wrote to. KEYS: each session's set of
# scopes; ARGV: the prefix of the scopes' lists, then each session's id. (The scopes'
# keys are read from the sets: a single Redis, not a cluster.)
_R_MEMORY_DROP = """
for i = 1, #KEYS do
  local sid = ARGV[i + 1]
  local mark = sid .. '\\n'
  for _, scope in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    local key = ARGV[1] .. scope
    local kept = {}
    for _, e in ipairs(redis.call('LRANGE', key, 0, -1)) do
      if string.sub(e, 1, #mark) ~= mark then table.insert(kept, e) end
    end
    redis.call('DEL', key)
    for j = 1, #kept, 1000 do
      redis.call('RPUSH', key, unpack(kept, j, math.min(j + 999, #kept)))
    end
  end
  redis.call('DEL', KEYS[i])
end
return 1
"""
_R_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_R_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``SCAN MATCH``)."""
    return "".join("\\" + c if c in "*?[]\\^-" else c for c in text)


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
        self._truncate = self._r.register_script(_R_TRUNCATE)
        self._delete = self._r.register_script(_R_DELETE)
        self._summary = self._r.register_script(_R_SUMMARY)
        self._memory_append = self._r.register_script(_R_MEMORY_APPEND)
        self._memory_drop = self._r.register_script(_R_MEMORY_DROP)
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
        if not created:
            return fields  # (the epoch, like created_at, never changes)
        return [*fields, "created_at", repr(state.created_at), "epoch", new_epoch()]

    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        if not self.create_if_missing(state, messages):
            raise StoreError(f"session {state.session_id!r} already exists")

    def create_if_missing(self, state: SessionState, messages: Sequence[Message] = ()) -> bool:
        now = time.time()
        state = replace(state, created_at=state.created_at or now, updated_at=now)
        skey, mkey = self._keys(state.session_id)
        records = [json.dumps(m.to_record()) for m in messages]
        args = [state.session_id, len(records), *records, *self._fields(state, created=True)]
        keys = [skey, f"{self.prefix}sessions", mkey]
        return bool(self._run(self._create, state.session_id, keys, args))  # one script: atomic

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        skey, mkey = self._keys(session_id)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC: one consistent snapshot
            pipe.hgetall(skey)
            pipe.lrange(mkey, 0, -1)
            row, records = pipe.execute()
        state = self._state_of(session_id, row)
        return state, self._stitched(state, [Message.from_record(json.loads(r)) for r in records])

    def load_tail(self, session_id: str, after: int) -> StoredTail:
        """See :meth:`Store.load_tail`: ``HGETALL``, ``LLEN`` and ``LRANGE after -1`` in
        one MULTI/EXEC."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        skey, mkey = self._keys(session_id)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)
            pipe.hgetall(skey)
            pipe.llen(mkey)
            pipe.lrange(mkey, after, -1)
            row, count, records = pipe.execute()
        state = self._state_of(session_id, row)
        messages = [Message.from_record(json.loads(r)) for r in records]
        return StoredTail(state=state, count=int(count), after=after, messages=messages)

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
            epoch=row.get("epoch", ""),  # none: stored before epochs
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

    def truncate(self, session_id: str, keep: int, *, state: SessionState | None = None) -> None:
        skey, mkey = self._keys(session_id)
        if state is not None:
            fields = self._fields(replace(state, updated_at=time.time()), created=False)
        else:
            fields = ["updated_at", repr(time.time())]
        fields = [*fields, "epoch", new_epoch()]  # another history: a new epoch
        if not self._run(self._truncate, session_id, [skey, mkey], [max(keep, 0), *fields]):
            raise SessionNotFound(f"no session {session_id!r}")

    def save_state(self, state: SessionState) -> None:
        fields = self._fields(replace(state, updated_at=time.time()), created=False)
        if not self._run(self._save, state.session_id, [self._keys(state.session_id)[0]], fields):
            raise SessionNotFound(f"no session {state.session_id!r}")

    def save_summary(
        self,
        session_id: str,
        *,
        summary: str,
        covered_from: int,
        summarized_turns: int,
        epoch: str | None = None,
    ) -> bool:
        fence = ["0", ""] if epoch is None else ["1", epoch]
        args: list[str | int] = [str(covered_from), summary, summarized_turns, repr(time.time()), *fence]
        done = int(self._summary(keys=[self._keys(session_id)[0]], args=args))
        if done < 0:
            raise SessionNotFound(f"no session {session_id!r} in {self.url}")
        return done == 1

    def delete(self, session_id: str, *, forks: bool = False) -> None:
        skey, mkey = self._keys(session_id)
        doomed = self.forks_of(session_id) if forks and self.exists(session_id) else []
        fork_keys = [k for sid in doomed for k in self._keys(sid)]
        if self.exists(session_id):
            # Memory first: a crash between the two leaves a session without memory (its
            # index is rebuilt from its turns), never memory without its session.
            self._drop_memory([session_id, *doomed])
        keys = [skey, mkey, f"{self.prefix}sessions", *fork_keys]
        if not self._run(self._delete, session_id, keys, [session_id, *doomed]):  # one script: atomic
            raise SessionNotFound(f"no session {session_id!r}")

    def forks_of(self, session_id: str) -> list[str]:
        """See :meth:`Store.forks_of`: an ``SSCAN`` of the ids matching ``<id>~*``. Forks
        are made under their session's lock (a server fork), so a delete that holds it
        sees them all."""
        pattern = _glob_escape(session_id + FORK_SEPARATOR) + "*"
        with self._errors():
            row: Mapping[str, str] = self._r.hgetall(self._keys(session_id)[0])  # type: ignore[assignment]
            owner = self._state_of(session_id, row).owner
            ids = [str(s) for s in self._r.sscan_iter(f"{self.prefix}sessions", match=pattern, count=1000)]
            ids = sorted(s for s in ids if is_fork_of(s, session_id))
            pipe = self._r.pipeline(transaction=False)
            for sid in ids:
                pipe.hget(self._keys(sid)[0], "owner")
            owners = pipe.execute() if ids else []
        return [sid for sid, o in zip(ids, owners, strict=True) if o == owner]

    # -- retrieval memory (see Store.append_memory) ---------------------------------------
    memory_persisted = True

    def _memory_key(self, scope: str) -> str:
        return f"{self.prefix}mem:{scope}"

    def append_memory(
        self,
        scope: str,
        records: Sequence[Mapping[str, Any]],
        *,
        session_id: str | None,
        epoch: str | None = None,
    ) -> bool:
        """See :meth:`Store.append_memory`: one script, fenced by the session's lease
        (:class:`~convo.errors.SessionLockLost` if it expired) and by its epoch; rows of
        no session in one MULTI/EXEC."""
        entries = [f"{session_id or ''}\n{json.dumps(dict(r))}" for r in records]
        if session_id is None:
            if entries:
                with self._errors():
                    self._r.rpush(self._memory_key(scope), *entries)
            return True
        keys = [self._keys(session_id)[0], self._memory_key(scope), f"{self.prefix}mscopes:{session_id}"]
        fence = ["0", ""] if epoch is None else ["1", epoch]
        args = [*fence, scope, len(entries), *entries]
        return bool(self._run(self._memory_append, session_id, keys, args))

    def memory_log(self, scope: str, after: int = 0) -> MemoryLog:
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        key = self._memory_key(scope)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)
            pipe.llen(key)
            pipe.lrange(key, after, -1)
            count, entries = pipe.execute()
        records = [json.loads(e.split("\n", 1)[1]) for e in entries]
        return MemoryLog(scope=scope, count=int(count), after=after, records=records)

    def memory_counts(self, scopes: Sequence[str]) -> dict[str, int]:
        with self._errors():
            pipe = self._r.pipeline(transaction=False)
            for scope in scopes:
                pipe.llen(self._memory_key(scope))
            counts = pipe.execute() if scopes else []
        return {s: int(c) for s, c in zip(scopes, counts, strict=True)}

    def delete_memory(self, scope: str) -> int:
        key = self._memory_key(scope)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)
            pipe.llen(key)
            pipe.delete(key)
            count, _ = pipe.execute()
        return int(count)

    def _drop_memory(self, session_ids: Sequence[str]) -> None:
        keys = [f"{self.prefix}mscopes:{sid}" for sid in session_ids]
        with self._errors():
            self._memory_drop(keys=keys, args=[f"{self.prefix}mem:", *session_ids])

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
