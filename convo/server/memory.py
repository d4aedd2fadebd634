"""Retrieval memory in the server: each session retrieves its own evicted turns (and, with
a person named, that person's earlier sessions), kept in the session store.

What an index needs is written to the store as :class:`~convo.retrieval.scopes.MemoryRecord`
rows (:meth:`Store.append_memory`), by the turn that indexes it, under the session's lock
and fenced by its epoch (and, on Redis, its lease). The indexes themselves are a cache::

    request ─ Session ─ MemoryView.retrieve / remember_turns
                             │
                  ServerMemory: LRU of scopes, at most cache_bytes ── hit: catch up with
                             │                                        records other replicas
                             │ miss: rebuild from the store's          wrote since (a count
                             ▼       records (no embedder call)        per member, then the tail)
                  store: memory rows of scope <session id>  (turn records, with vectors)
                                     of scope person/<key>/<user>  (which sessions are theirs)

So any replica serves any session, a restart or ``kill -9`` loses no acknowledged turn's
memory (a turn whose records were not written yet is indexed again from its stored
messages by the next request), and a replica's memory is bounded by ``cache_bytes``
whatever the number of sessions and people (``convo_memory_cache_bytes`` on ``/metrics``).

A person (``user`` or ``metadata.user_id`` of a request) is scoped by API key: the scope
``person/<key hash>/<user>`` is built only from sessions of that key, so one key never
reads another key's people. :meth:`ServerMemory.forget_person` removes the person's scope
and their sessions' memory rows, and drops every cached index built from them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from convo.embeddings import TextEncoder
from convo.errors import ConfigError, SessionNotFound
from convo.plan import Passage, Retriever, Turn, split_turns
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.scopes import MemoryRecord, ScopedMemory
from convo.session.ahead import ahead_stats
from convo.stores import Store

logger = logging.getLogger(__name__)

#: Default of ``--memory-cache-mb``: the bytes of indexes one replica keeps, 256 MiB.
DEFAULT_MEMORY_CACHE_BYTES = 256 << 20
#: Default of ``--embedding-device``: the server's embedding model runs on the CPU, also
#: beside a GPU chat model. On the H200 (gpu-chat load, Llama-2-7B int4, 16 slots, memory on)
#: a MiniLM on the same GPU made the load 2.26x as long as memory off, its passes queued
#: behind the chat model's kernel launches and the GIL (a window-slide turn waited 4.8 s
#: in retrieval); on the host's CPU 1.48x (0.29 s). With the model in a child process of its
#: own (``--embedding-process``, the default) the CPU gives 1.22-1.26x on an H100 and the
#: GPU still 1.52x (its slide turn's retrieval 1.9 s): not only the GIL, the GPU's queue too.
#: ``--embedding-device cuda`` asks for it.
DEFAULT_EMBEDDING_DEVICE = "cpu"

#: Longest person id (``user`` / ``metadata.user_id``), in characters (OpenAI's ``user``
#: is a free string; ours names a scope in the store).
MAX_USER_ID_CHARS = 128

#: The op of a person scope's rows: "this session is the person's".
_MEMBER = "member"


def person_scope(owner: str, user: str) -> str:
    """The scope of person ``user`` of the API key whose hash is ``owner`` (a ``/``, which
    no server session id holds, keeps it apart from every session's own scope)."""
    return f"person/{owner}/{user}"


def check_user_id(user: str) -> str:
    """A person id as given, or ConfigError (400) when it is empty, too long or has
    control characters."""
    if not isinstance(user, str) or not user or len(user) > MAX_USER_ID_CHARS:
        raise ConfigError(f"a user id must be 1 to {MAX_USER_ID_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in user):
        raise ConfigError("a user id must not contain control characters")
    return user


@dataclass
class _Entry:
    """One cached index: a scope, the sessions whose records it replayed and how many."""

    scope: str
    memory: ScopedMemory
    members: list[str] = field(default_factory=list)
    applied: dict[str, int] = field(default_factory=dict)
    epochs: dict[str, str] = field(default_factory=dict)  # the epoch of each session's rows
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass(frozen=True)
class MemoryCacheStats:
    """What ``/metrics`` shows of the cache (see :meth:`ServerMemory.stats`)."""

    entries: int
    bytes: int
    cache_bytes: int
    hits: int
    misses: int
    rebuild_s: float
    evictions: int


class ServerMemory:
    """The server's retrieval memory: indexes per scope, cached, rebuilt from the store.

    Args:
        store: the session store (its memory rows are the truth; see module docstring).
        embedder: the text encoder (:class:`~convo.embeddings.Embedder` in ``convo serve``).
        cache_bytes: most bytes of indexes kept (LRU); default
            :data:`DEFAULT_MEMORY_CACHE_BYTES`. One index larger than this is still built
            for the request that needs it, and dropped when another is needed.
        config: ranking of a session's own memory (default :class:`RetrievalConfig`, as in
            the SDK); a person's scope ranks with :class:`ScopedMemory`'s default.
    """

    def __init__(
        self,
        store: Store,
        embedder: TextEncoder,
        *,
        cache_bytes: int = DEFAULT_MEMORY_CACHE_BYTES,
        config: RetrievalConfig | None = None,
    ) -> None:
        if cache_bytes < 0:
            raise ConfigError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.store = store
        self.embedder = embedder
        self.cache_bytes = cache_bytes
        self.config = config
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0
        self._rebuild_s = 0.0

    # -- what a request uses -----------------------------------------------------------------
    def view(self, *, owner: str, user: str | None = None) -> MemoryView:
        """The retriever a request's Session gets: its own session's scope, or with
        ``user`` that person's scope (of the key ``owner``)."""
        person = person_scope(owner, check_user_id(user)) if user is not None else None
        return MemoryView(self, person)

    def session_reset(self, session_id: str) -> None:
        """The session's history was rewritten (a fork): what was indexed of it before is
        forgotten (a ``reset`` record, under the caller's lock on the session)."""
        reset = MemoryRecord(session_id=session_id, op="reset").to_dict()
        if self.store.append_memory(session_id, [reset], session_id=session_id):
            self._drop_where(lambda e: session_id in e.applied or e.scope == session_id)

    def session_deleted(self, session_ids: Sequence[str]) -> None:
        """Drop the cached indexes built from ``session_ids`` (the store deleted their rows)."""
        doomed = set(session_ids)
        self._drop_where(lambda e: bool(doomed & set(e.applied)) or e.scope in doomed)

    def forget_person(self, owner: str, user: str) -> dict[str, Any]:
        """Forget person ``user`` of key ``owner``: their scope's rows, every memory row of
        their sessions, and every cached index built from them. Returns what was removed."""
        scope = person_scope(owner, check_user_id(user))
        members = self._members(scope)
        rows = 0
        for sid in members:
            rows += self.store.delete_memory(sid)
            try:
                _, messages = self.store.load(sid)
            except SessionNotFound:
                continue
            # The session stays: what it said so far is never indexed again (a floor), what
            # it says from now on is.
            floor = MemoryRecord(session_id=sid, op="floor", turn=len(split_turns(messages))).to_dict()
            self.store.append_memory(sid, [floor], session_id=sid)
        rows += self.store.delete_memory(scope)
        self._drop_where(lambda e: e.scope == scope or bool(set(members) & set(e.applied)))
        return {"sessions": members, "records_deleted": rows}

    def person_export(self, owner: str, user: str) -> dict[str, Any]:
        """What the server remembers of a person: their sessions and turns (dates, texts)."""
        scope = person_scope(owner, check_user_id(user))
        sessions = []
        for sid in self._members(scope):
            turns: dict[int, dict[str, Any]] = {}
            for raw in self.store.memory_log(sid).records:
                rec = MemoryRecord.from_dict(raw)
                if rec.op == "floor":
                    turns = {t: v for t, v in turns.items() if t >= rec.turn}
                    continue
                if rec.op == "reset":
                    turns.clear()
                    continue
                turns[rec.turn] = {
                    "turn": rec.turn,
                    "date": rec.date,
                    "messages": [{"role": r, "content": c} for r, _, c in rec.messages],
                }
            sessions.append({"session_id": sid, "turns": [turns[t] for t in sorted(turns)]})
        return {"object": "user.memory", "user": user, "sessions": sessions}

    # -- the cache ------------------------------------------------------------------------------
    def stats(self) -> MemoryCacheStats:
        with self._lock:
            return MemoryCacheStats(
                entries=len(self._cache),
                bytes=sum(e.memory.nbytes for e in self._cache.values()),
                cache_bytes=self.cache_bytes,
                hits=self._hits,
                misses=self._misses,
                rebuild_s=self._rebuild_s,
                evictions=self._evictions,
            )

    def entry(self, scope: str, *, person: bool) -> _Entry:
        """The cached index of ``scope``, caught up with the store (rebuilt on a miss)."""
        with self._lock:
            entry = self._cache.get(scope)
            if entry is not None:
                self._cache.move_to_end(scope)
                self._hits += 1
            else:
                self._misses += 1
        if entry is None:
            started = time.monotonic()
            entry = self._new_entry(scope, person=person)
            with entry.lock:
                self._catch_up(entry, person=person)
            with self._lock:
                self._rebuild_s += time.monotonic() - started
                self._cache[scope] = entry
        else:
            with entry.lock:
                if not self._catch_up(entry, person=person):
                    return self._rebuilt(scope, person=person)
        return entry

    def _rebuilt(self, scope: str, *, person: bool) -> _Entry:
        with self._lock:
            self._cache.pop(scope, None)
        return self.entry(scope, person=person)

    def _new_entry(self, scope: str, *, person: bool) -> _Entry:
        if person:
            memory = ScopedMemory(self.embedder, scope=scope)
        else:
            memory = ScopedMemory(
                self.embedder, scope=scope, config=self.config or RetrievalConfig(), date_turns=False
            )
        return _Entry(scope=scope, memory=memory)

    def _members(self, scope: str) -> list[str]:
        """The sessions of a person scope, in the order they joined."""
        seen: dict[str, None] = {}
        for r in self.store.memory_log(scope).records:
            if r.get("op") == _MEMBER:
                seen.setdefault(str(r["session"]), None)
        return list(seen)

    def _catch_up(self, entry: _Entry, *, person: bool) -> bool:
        """Replay the records written since ``entry`` last looked; False when the store
        no longer holds what it replayed (a session deleted or re-created): rebuild."""
        members = self._members(entry.scope) if person else [entry.scope]
        if members[: len(entry.members)] != entry.members:
            return False
        counts = self.store.memory_counts(members)
        for sid in members:
            done = entry.applied.get(sid, 0)
            if counts[sid] < done:
                return False
            if counts[sid] > done:
                log = self.store.memory_log(sid, after=done)
                epochs = {str(r.get("epoch", "")) for r in log.records}
                known = entry.epochs.get(sid)
                if (known is not None and epochs - {known}) or len(epochs) > 1:
                    return False  # the session was deleted and made again since
                if epochs:
                    entry.epochs[sid] = epochs.pop()
                entry.memory.apply(MemoryRecord.from_dict(r) for r in log.records)
                entry.applied[sid] = log.count
        entry.members = members
        self._evict(keep=entry.scope)
        return True

    def _evict(self, keep: str) -> None:
        """Drop least recently used indexes until the cache fits (``keep`` goes last)."""
        with self._lock:
            total = sum(e.memory.nbytes for e in self._cache.values())
            for scope in list(self._cache):
                if total <= self.cache_bytes:
                    break
                if scope == keep:
                    continue
                total -= self._cache.pop(scope).memory.nbytes
                self._evictions += 1

    def _drop_where(self, doomed: Any) -> None:
        with self._lock:
            for scope in [s for s, e in self._cache.items() if doomed(e)]:
                del self._cache[scope]

    # -- the two calls, for one session ------------------------------------------------------------
    def remember(
        self, person: str | None, session_id: str, turns: Sequence[Turn], dates: Mapping[int, str] | None
    ) -> None:
        try:
            state, _ = self.store.peek(session_id)
        except SessionNotFound:
            return
        if person is not None and session_id not in self._members(person):
            member = {"op": _MEMBER, "session": session_id}
            self.store.append_memory(person, [member], session_id=session_id, epoch=state.epoch)
        scope = person or session_id
        entry = self.entry(scope, person=person is not None)
        if entry.epochs.get(session_id, state.epoch) != state.epoch:
            entry = self._rebuilt(scope, person=person is not None)  # made again since
        with entry.lock:
            records = entry.memory.index_turns(session_id, turns, dates=dates)
            if not records:
                return
            rows = [{**r.to_dict(), "epoch": state.epoch} for r in records]
            if self.store.append_memory(session_id, rows, session_id=session_id, epoch=state.epoch):
                entry.applied[session_id] = entry.applied.get(session_id, 0) + len(rows)
                entry.epochs[session_id] = state.epoch
                if session_id not in entry.members:
                    entry.members.append(session_id)
            else:  # the session went meanwhile: what was just indexed must not stay
                self._drop_where(lambda e: e is entry)
        self._evict(keep=scope)

    def prepare(
        self, person: str | None, session_id: str, turns: Sequence[Turn], dates: Mapping[int, str] | None
    ) -> int:
        """Embed ahead what :meth:`remember` will embed for ``turns`` (a background thread,
        after a reply; see :mod:`convo.session.ahead`), when the scope's index is cached:
        else the next turn rebuilds it from the store, whose records hold their vectors."""
        entry = self._cached(person or session_id)
        return 0 if entry is None else entry.memory.prepare_turns(session_id, turns, dates=dates)

    def turns_ready(
        self, person: str | None, session_id: str, turns: Sequence[Turn], dates: Mapping[int, str] | None
    ) -> int:
        """How many of ``turns`` (in the window still) to index on this turn: all when the
        scope's index is not cached (a restart, a ``kill -9``, a session new to this
        replica, an LRU eviction), as it is rebuilt from the store on this turn anyway, so
        that every acknowledged turn is in the store again; else none (see
        :class:`~convo.plan.PreparesTurns`)."""
        entry = self._cached(person or session_id)
        return len(turns) if entry is None else entry.memory.turns_ready(session_id, turns, dates=dates)

    def _cached(self, scope: str) -> _Entry | None:
        """The cached index of ``scope`` as it is (not caught up, not counted as a hit)."""
        with self._lock:
            return self._cache.get(scope)

    def retrieve(
        self, person: str | None, query: str, session_id: str, top_k: int, today: date | str | None
    ) -> list[Passage]:
        scope = person or session_id
        entry = self.entry(scope, person=person is not None)
        known = entry.epochs.get(session_id)
        if known is not None:
            # Deleted and made again elsewhere (maybe by another key) with no row yet: this
            # replica's index of the old session must not answer for the new one.
            try:
                epoch = self.store.peek(session_id)[0].epoch
            except SessionNotFound:
                epoch = None
            if epoch != known:
                entry = self._rebuilt(scope, person=person is not None)
        with entry.lock:
            return entry.memory.retrieve(query, session_id=session_id, top_k=top_k, today=today)


class MemoryView(Retriever):
    """The retriever of one request's Session: :class:`ServerMemory` for its scope."""

    supports_today = True

    def __init__(self, memory: ServerMemory, person: str | None) -> None:
        self.memory = memory
        self.person = person
        # A session's own memory is searched by it alone; a person's by all their sessions.
        self.defer_window_turns = person is None
        self.min_score = (memory.config or RetrievalConfig()).min_score

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        self.memory.remember(self.person, session_id, turns, dates)

    def prepare_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        return self.memory.prepare(self.person, session_id, turns, dates)

    def turns_ready(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        return self.memory.turns_ready(self.person, session_id, turns, dates)

    def retrieve(
        self, query: str, *, session_id: str, top_k: int, today: date | str | None = None
    ) -> list[Passage]:
        return self.memory.retrieve(self.person, query, session_id, top_k, today)


class MemoryCollector(Collector):
    """The caches' size and traffic on ``/metrics``: the memory's indexes and, given, the
    vector stores' (``documents``: a :class:`~convo.server.documents.Documents`)."""

    def __init__(self, memory: ServerMemory, documents: Any = None) -> None:
        self.memory = memory
        self.documents = documents

    def collect(self) -> Iterator[Any]:
        if self.documents is not None:
            yield GaugeMetricFamily(
                "convo_documents_cache_bytes",
                "bytes of vector-store indexes cached",
                value=self.documents.cache_bytes,
            )
        s = self.memory.stats()
        yield GaugeMetricFamily(
            "convo_memory_cache_bytes", "bytes of retrieval indexes cached", value=s.bytes
        )
        yield GaugeMetricFamily(
            "convo_memory_cache_limit_bytes", "most bytes of retrieval indexes cached", value=s.cache_bytes
        )
        yield GaugeMetricFamily("convo_memory_cache_entries", "retrieval indexes cached", value=s.entries)
        yield CounterMetricFamily(
            "convo_memory_cache_hits", "index lookups served from the cache", value=s.hits
        )
        yield CounterMetricFamily(
            "convo_memory_cache_misses", "index lookups rebuilt from the store", value=s.misses
        )
        yield CounterMetricFamily(
            "convo_memory_rebuild_seconds",
            "seconds spent rebuilding indexes from the store",
            value=s.rebuild_s,
        )
        yield CounterMetricFamily("convo_memory_cache_evictions", "indexes dropped by LRU", value=s.evictions)
        ahead = ahead_stats()
        for name, doc, value in (
            ("embedded_ahead_texts", "texts embedded in the background after a reply", ahead.texts),
            ("embed_ahead_jobs", "embed-ahead jobs run", ahead.done),
            ("embed_ahead_dropped", "embed-ahead jobs dropped (backlog full)", ahead.dropped),
            ("embed_ahead_failed", "embed-ahead jobs failed", ahead.failed),
        ):
            yield CounterMetricFamily(f"convo_memory_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "convo_memory_embed_ahead_backlog", "embed-ahead jobs waiting", value=ahead.backlog
        )
