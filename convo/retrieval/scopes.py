"""Memory above the session: one ranking over the turns of several sessions (a person's).

A :class:`ScopedMemory` is a :class:`~convo.plan.Retriever` that several
:class:`~convo.session.Session` objects share. Each session's turns go into one
:class:`~convo.retrieval.RetrievalMemory` index, so a new session of that person retrieves
from their earlier sessions and from its own evicted turns in **one ranking**, inside the
same ``retrieval_tokens`` budget as a session alone::

    Session "mon" ─┐                 ┌─ turn 3 of "mon"   [2026-11-30]  (another session's:
    Session "tue" ─┼─ ScopedMemory ──┤                                   key "session:mon:turn:3:0")
    Session "wed" ─┘  (one index)    └─ turn 1 of "wed"   [2026-12-02]  (this session's: "turn:1:0",
                                                                         dropped while in the window)

Every passage is tagged with its session (``meta["session_id"]``) and its date, and shows the
date (``[2026-11-30]``, from the date the session gives the turn, else the day its first
message was written). Where facts changed, the newest is preferred: the default config of a
scope raises later days (``recency_weight``, see :data:`PERSON_RECENCY_WEIGHT`).

Each index call also returns :class:`MemoryRecord` objects: what a turn was indexed as and
the vectors the embedder computed for it. Replayed with :meth:`ScopedMemory.apply`, they
rebuild the same index without calling the embedder: the server keeps them in its session
store (:meth:`convo.stores.Store.append_memory`) so that any replica rebuilds any index.

Example:
    >>> alice = ScopedMemory(embedder, scope="alice")                  # doctest: +SKIP
    >>> monday = Session(engine, retriever=alice, session_id="mon")    # doctest: +SKIP
    >>> tuesday = Session(engine, retriever=alice, session_id="tue")   # doctest: +SKIP
    >>> alice.forget()   # every session's memory of alice, and the index built from it  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import date, datetime
from typing import Any

import numpy as np

from convo.embeddings import Embedder, TextEncoder
from convo.errors import ConfigError
from convo.messages import Message, Role
from convo.plan import Passage, Retriever, Turn, turn_key
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.memory import RetrievalMemory

__all__ = ["PERSON_RECENCY_WEIGHT", "SESSION_TURNS_MAX", "MemoryRecord", "RecordingEncoder", "ScopedMemory"]

#: Turns one session may hold in a scope: each session gets a block of this many turn
#: numbers in the shared index, so two sessions' turns never share a key and a session's
#: turns stay neighbours. A turn numbered past it is refused (ConfigError).
SESSION_TURNS_MAX = 1_000_000

#: The ``recency_weight`` a person's scope ranks with by default (a session alone keeps
#: :class:`RetrievalConfig`'s): where a fact changed across sessions, the later day wins
#: a near tie (knowledge updates).
PERSON_RECENCY_WEIGHT = 0.05

#: Version of the records :meth:`ScopedMemory.index_turns` returns.
RECORD_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class MemoryRecord:
    """One turn as a scope indexed it, JSON-safe (:meth:`to_dict`), to rebuild the index.

    Attributes:
        session_id: the session the turn belongs to.
        turn: its number in that session.
        date: the date it was indexed with (``None``: undated).
        messages: ``(role, name, content)`` of its messages.
        digest: a hash of the above: a turn indexed again with the same digest is skipped.
        vectors: every text the embedder was asked for while indexing it, with its vector
            (float32): a replay needs no embedder.
        encoder: what computed ``vectors`` (:func:`encoder_identity`; ``""`` in records
            written before it was kept): a replay by another embedding model embeds the
            texts again instead of mixing two models' vectors in one index.
        op: ``"turn"``; ``"reset"`` forgets every turn of ``session_id`` indexed before
            (its history was rewritten); ``"floor"``: turns of ``session_id`` numbered
            below ``turn`` are forgotten and never indexed again (a person forgotten while
            the session stays).
    """

    session_id: str
    turn: int = 0
    date: str | None = None
    messages: tuple[tuple[str, str | None, str], ...] = ()
    digest: str = ""
    vectors: Mapping[str, np.ndarray] = field(default_factory=dict)
    op: str = "turn"
    encoder: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: vectors as base64 of little-endian float32."""
        out = {
            "v": RECORD_FORMAT,
            "op": self.op,
            "session": self.session_id,
            "turn": self.turn,
            "date": self.date,
            "messages": [list(m) for m in self.messages],
            "digest": self.digest,
            "vectors": {
                t: base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
                for t, v in self.vectors.items()
            },
        }
        if self.encoder:
            out["encoder"] = self.encoder
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryRecord:
        """Read :meth:`to_dict` output. Raises ValueError for what is not a record."""
        if data.get("v") != RECORD_FORMAT or data.get("op") not in ("turn", "reset", "floor"):
            raise ValueError(f"not a convo memory record: {str(data)[:80]!r}")
        vectors = {
            t: np.frombuffer(base64.b64decode(b), dtype="<f4") for t, b in dict(data["vectors"]).items()
        }
        return cls(
            op=str(data["op"]),
            session_id=str(data["session"]),
            turn=int(data["turn"]),
            date=None if data.get("date") is None else str(data["date"]),
            messages=tuple((str(r), None if n is None else str(n), str(c)) for r, n, c in data["messages"]),
            digest=str(data["digest"]),
            vectors=vectors,
            encoder=str(data.get("encoder") or ""),
        )

    @property
    def nbytes(self) -> int:
        """About what the record holds in memory once indexed (texts and vectors)."""
        text = sum(len(c) for _, _, c in self.messages)
        return 3 * text + 2 * sum(int(v.nbytes) + len(t) for t, v in self.vectors.items())


class RecordingEncoder:
    """A :class:`~convo.embeddings.TextEncoder` around ``base`` that records what it
    computes (while :meth:`taping`) and answers from :attr:`known` vectors (preloaded to
    replay records) before asking ``base``: an index rebuilt from stored vectors."""

    def __init__(self, base: TextEncoder) -> None:
        self.base = base
        self.known: dict[str, np.ndarray] = {}
        self.tape: dict[str, np.ndarray] | None = None

    @property
    def dim(self) -> int:
        return self.base.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self.known]
        fresh: dict[str, np.ndarray] = {}
        if missing:
            fresh = dict(zip(missing, np.asarray(self.base.encode(missing), dtype=np.float32), strict=True))
        if self.tape is not None:
            for t in texts:
                self.tape[t] = fresh[t] if t in fresh else self.known[t]
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        return np.stack([fresh[t] if t in fresh else self.known[t] for t in texts]).astype(np.float32)

    @contextmanager
    def taping(self) -> Iterator[dict[str, np.ndarray]]:
        self.tape = tape = dict[str, np.ndarray]()
        try:
            yield tape
        finally:
            self.tape = None


def encoder_identity(encoder: TextEncoder) -> str:
    """What a record's vectors came from: the encoder's own ``model_id`` when it has one
    (:attr:`Embedder.model_id <convo.embeddings.Embedder.model_id>`), else its class and
    vector length."""
    ident = getattr(encoder, "model_id", None)
    if isinstance(ident, str) and ident:
        return ident
    return f"{type(encoder).__name__}/{encoder.dim}"


def _digest(messages: Sequence[tuple[str, str | None, str]], day: str | None) -> str:
    return hashlib.sha1(json.dumps([list(messages), day]).encode()).hexdigest()[:20]


def _day_of(turn: Turn) -> str | None:
    """The ISO day the turn's first message was written (``created_at``, local time)."""
    for m in turn.messages:
        if m.created_at:
            return datetime.fromtimestamp(m.created_at).date().isoformat()
    return None


class ScopedMemory(Retriever):
    """A retrieval memory shared by the sessions of one scope (a person), one ranking.

    Args:
        embedder: the text encoder (default :class:`~convo.embeddings.Embedder`).
        scope: a name for the scope (e.g. the person's id); shown nowhere but in logs.
        config: ranking settings; default :class:`RetrievalConfig` with
            ``recency_weight`` :data:`PERSON_RECENCY_WEIGHT`.
        date_turns: date a turn the session gives no date for by the day its first
            message was written. Default True (each passage shows its date).

    Attributes:
        min_score: passages below this fused score are dropped by the planner.
    """

    supports_today = True

    def __init__(
        self,
        embedder: TextEncoder | None = None,
        *,
        scope: str = "person",
        config: RetrievalConfig | None = None,
        date_turns: bool = True,
    ) -> None:
        if not isinstance(scope, str) or not scope:
            raise ConfigError("scope must be a non-empty string")
        self.scope = scope
        self.date_turns = date_turns
        self.config = config or RetrievalConfig(recency_weight=PERSON_RECENCY_WEIGHT)
        self._encoder = RecordingEncoder(embedder if embedder is not None else Embedder())
        self._encoder_id: str | None = None  # (encoder_identity of the embedder, on first use)
        self._memory = RetrievalMemory(self._encoder, config=self.config)
        self.min_score: float = self._memory.min_score
        self._slots: dict[str, int] = {}  # session -> its block of turn numbers
        self._by_slot: list[str] = []
        self._digests: dict[str, dict[int, str]] = {}  # session -> turn -> digest
        self._floors: dict[str, int] = {}  # session -> its first turn that may be indexed
        self._bytes = 0
        self._lock = threading.RLock()

    # -- what a Session calls ----------------------------------------------------------------
    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        """Index completed turns of ``session_id`` into the scope (see :meth:`index_turns`)."""
        self.index_turns(session_id, turns, dates=dates)

    def retrieve(
        self, query: str, *, session_id: str, top_k: int, today: date | str | None = None
    ) -> list[Passage]:
        """Passages about ``query`` from every session of the scope, one ranking. This
        session's own turns keep their keys (``turn_key``), so the planner drops those in its
        window; another session's are keyed ``session:<id>:turn:<n>:<line>``."""
        with self._lock:
            found = self._memory.retrieve(query, session_id=self.scope, top_k=top_k, today=today)
            return [self._tagged(p, session_id) for p in found]

    # -- indexing and replay -------------------------------------------------------------------
    def index_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> list[MemoryRecord]:
        """Index the turns not indexed yet (or changed) and return their records, with the
        vectors computed for them; a turn indexed before with the same content is skipped
        (a server session is loaded anew per request and hands over every turn)."""
        with self._lock:
            todo = self._unindexed(session_id, turns, dates)
            if not todo:
                return []
            with self._encoder.taping() as tape:
                self._index(todo)
            # Every vector goes with the first record of the batch (one call computed them).
            out = [replace(todo[0], vectors=dict(tape), encoder=self.encoder_id), *todo[1:]]
            self._bytes += sum(r.nbytes for r in out)
            return out

    #: The scope's sessions search each other's turns: each is indexed once completed.
    defer_window_turns = False

    def prepare_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        """Embed ahead, into the embedder's caches, what :meth:`index_turns` would embed for
        the turns of ``turns`` not indexed yet; index nothing. A background thread calls it
        after a turn, so that the next turn's indexing finds its vectors computed. Returns
        how many texts were embedded."""
        with self._lock:
            todo = self._unindexed(session_id, turns, dates)
            slot = self._slots.get(session_id, len(self._by_slot))
            scoped, days = self._scoped_turns(todo, slot)
            texts = self._memory.embedding_texts(self.scope, scoped, dates=days) if scoped else []
        if texts:  # (outside the lock: turns of the scope's other sessions go on meanwhile)
            self._encoder.base.encode(texts)
        return len(texts)

    def turns_ready(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        """0: a turn the window shows is indexed when it leaves it (see
        :class:`~convo.plan.PreparesTurns`)."""
        return 0

    def _unindexed(
        self, session_id: str, turns: Sequence[Turn], dates: Mapping[int, str] | None
    ) -> list[MemoryRecord]:
        """Records of the turns not indexed yet, or changed since (under ``_lock``)."""
        todo = []
        for turn in turns:
            msgs = tuple((m.role.value, m.name, m.content) for m in turn.messages if m.content.strip())
            day = (dates or {}).get(turn.index) or (_day_of(turn) if self.date_turns else None)
            digest = _digest(msgs, day)
            if turn.index < self._floors.get(session_id, 0):
                continue  # forgotten for good (see forget_before)
            if self._digests.get(session_id, {}).get(turn.index) == digest:
                continue
            todo.append(
                MemoryRecord(session_id=session_id, turn=turn.index, date=day, messages=msgs, digest=digest)
            )
        return todo

    @staticmethod
    def _scoped_turns(records: Sequence[MemoryRecord], slot: int) -> tuple[list[Turn], dict[int, str]]:
        """The turns of ``records`` (one session's) as the scope's index numbers them: the
        session's block ``slot`` of :data:`SESSION_TURNS_MAX` turns; and their dates."""
        turns, dates = [], {}
        for rec in records:
            if not 0 <= rec.turn < SESSION_TURNS_MAX:
                raise ConfigError(f"turn {rec.turn} of session {rec.session_id!r} is past SESSION_TURNS_MAX")
            index = slot * SESSION_TURNS_MAX + rec.turn
            msgs = tuple(Message(role=Role(r), name=n, content=c) for r, n, c in rec.messages)
            turns.append(Turn(index=index, messages=msgs))
            if rec.date:
                dates[index] = rec.date
        return turns, dates

    @property
    def encoder_id(self) -> str:
        """:func:`encoder_identity` of this scope's embedder (written on its records)."""
        if self._encoder_id is None:
            self._encoder_id = encoder_identity(self._encoder.base)
        return self._encoder_id

    def _vectors_fit(self, rec: MemoryRecord) -> bool:
        """Whether ``rec``'s stored vectors may stand for this embedder's: computed by it
        (or by an unnamed one, in older records) and of its length. Else the texts are
        embedded again: another model's vectors are never mixed into the index."""
        if not rec.vectors or (rec.encoder and rec.encoder != self.encoder_id):
            return False
        dim = self._encoder.dim
        return all(v.shape == (dim,) for v in rec.vectors.values())

    def apply(self, records: Iterable[MemoryRecord]) -> None:
        """Replay records (from :meth:`index_turns`, in order): the same index, built
        without calling the embedder for any text a record holds a vector of."""
        with self._lock:
            batch: list[MemoryRecord] = []
            for rec in records:
                if self._vectors_fit(rec):
                    self._encoder.known.update(rec.vectors)
                if rec.op in ("reset", "floor"):
                    self._index(batch)
                    batch = []
                    if rec.op == "reset":
                        self.forget_session(rec.session_id)
                    else:
                        self.forget_before(rec.session_id, rec.turn)
                    continue
                if rec.turn < self._floors.get(rec.session_id, 0):
                    continue
                if self._digests.get(rec.session_id, {}).get(rec.turn) == rec.digest:
                    continue
                if batch and batch[-1].session_id != rec.session_id:
                    self._index(batch)
                    batch = []
                batch.append(rec)
                self._bytes += rec.nbytes
            self._index(batch)
            self._encoder.known.clear()

    def _index(self, records: Sequence[MemoryRecord]) -> None:
        if not records:
            return
        sid = records[0].session_id
        turns, dates = self._scoped_turns(records, self._slot(sid))
        for rec in records:
            self._digests.setdefault(sid, {})[rec.turn] = rec.digest
        self._memory.remember_turns(self.scope, turns, dates=dates)

    def _slot(self, session_id: str) -> int:
        slot = self._slots.get(session_id)
        if slot is None:
            slot = self._slots[session_id] = len(self._by_slot)
            self._by_slot.append(session_id)
        return slot

    def _tagged(self, p: Passage, asking: str) -> Passage:
        """A passage of the shared index, keyed and cited for the session ``asking``."""
        parts = p.key.split(":")
        if len(parts) < 2 or parts[0] != "turn":
            return p  # a document chunk
        slot, local = divmod(int(parts[1]), SESSION_TURNS_MAX)
        sid = self._by_slot[slot]
        line = int(parts[2]) if len(parts) == 3 else None
        meta = {**p.meta, "session_id": sid, "turn": local}
        if sid == asking:
            return replace(p, key=turn_key(local, line), source=f"turn {local}", meta=meta)
        tail = turn_key(local, line)
        return replace(p, key=f"session:{sid}:{tail}", source=f"session {sid} turn {local}", meta=meta)

    # -- management ------------------------------------------------------------------------------
    def forget_session(self, session_id: str) -> int:
        """Drop every turn of ``session_id`` from the scope; returns how many were indexed."""
        with self._lock:
            done = self._digests.pop(session_id, {})
            slot = self._slots.get(session_id)
            if slot is None or not done:
                return 0
            return self._memory.forget_turns(self.scope, [slot * SESSION_TURNS_MAX + t for t in done])

    def forget_before(self, session_id: str, turn: int) -> int:
        """Forget the turns of ``session_id`` numbered below ``turn`` and never index them
        again (later turns are remembered as usual); returns how many were indexed."""
        with self._lock:
            self._floors[session_id] = max(self._floors.get(session_id, 0), turn)
            done = self._digests.get(session_id, {})
            gone = [t for t in done if t < turn]
            for t in gone:
                del done[t]
            slot = self._slots.get(session_id)
            if slot is None or not gone:
                return 0
            return self._memory.forget_turns(self.scope, [slot * SESSION_TURNS_MAX + t for t in gone])

    def forget(self) -> None:
        """Forget the whole scope: every session's turns and the index built from them."""
        with self._lock:
            self._memory = RetrievalMemory(self._encoder, config=self.config)
            self._slots.clear()
            self._by_slot.clear()
            self._digests.clear()
            self._floors.clear()
            self._bytes = 0

    def session_ids(self) -> list[str]:
        """Sessions with indexed turns, in the order they joined the scope."""
        with self._lock:
            return [s for s in self._by_slot if self._digests.get(s)]

    def turn_count(self, session_id: str | None = None) -> int:
        """Indexed turns of ``session_id`` (``None``: of every session)."""
        with self._lock:
            if session_id is not None:
                return len(self._digests.get(session_id, {}))
            return sum(len(d) for d in self._digests.values())

    @property
    def nbytes(self) -> int:
        """About what the index holds in memory, in bytes (texts, unit and word vectors):
        what a cache of scopes counts (see :mod:`convo.server.memory`)."""
        return self._bytes
