"""RetrievalMemory: what a session retrieves from.

Per session id it keeps a :class:`~convo.retrieval.units.UnitStore` of that session's
completed turns (one unit per message), what the ranking derives from them
(:class:`~convo.retrieval.features.UnitFeatures`) and its expansion vocabulary
(:class:`~convo.retrieval.expansion.Vocabulary`); it also sees shared
:class:`~convo.retrieval.DocumentCollection` objects. :meth:`RetrievalMemory.retrieve`
ranks one session's messages with :func:`~convo.retrieval.turn_ranking.rank_units` (the
stages of :mod:`convo.retrieval.ranking`, on arrays).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from convo.dates import as_day, day_label
from convo.embeddings import Embedder, TextEncoder
from convo.errors import ConfigError
from convo.messages import Message
from convo.plan import Passage, Retriever, Turn, turn_key
from convo.retrieval._io import FORMAT, child_folder, damaged, read_json, write_json
from convo.retrieval._threads import one_blas_thread
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.documents import DocumentCollection
from convo.retrieval.expansion import Vocabulary, expansion_words
from convo.retrieval.features import UnitFeatures
from convo.retrieval.indexes.bm25 import WORD, terms
from convo.retrieval.indexes.vector import DEFAULT_EXACT_MAX, DEFAULT_NPROBE
from convo.retrieval.ranking import mmr, strip_names, top_of
from convo.retrieval.turn_ranking import rank_units
from convo.retrieval.units import Hit, Record, UnitStore, passage_of
from convo.tokens import TokenCounter

__all__ = ["RetrievalMemory"]


def _owner(session_id: str) -> str:
    """The owner recorded in a session's saved files."""
    return f"session:{session_id}"


#: Day labels kept (LRU, by date string): every passage of a dated turn shows one, and a
#: search returns a hundred passages of a few dozen dates (issue 24).
DAY_LABELS_KEPT = 4096

_day_label = functools.lru_cache(maxsize=DAY_LABELS_KEPT)(day_label)

#: Characters of the previous message kept as context in a message's vector (its tail).
#: MiniLM reads 256 word pieces; a long previous message would otherwise fill them all and
#: leave none of the message's own text embedded (issue 24). About 100 word pieces.
CONTEXT_CHARS = 400


def _with_context(context: str, line: str) -> str:
    """The text a message is embedded as: the tail of ``context`` (at most
    :data:`CONTEXT_CHARS` characters, cut at a word), then the message's own ``line``."""
    if not context:
        return line
    if len(context) > CONTEXT_CHARS:
        tail = context[-CONTEXT_CHARS:]
        context = tail.split(" ", 1)[-1] if " " in tail else tail
    return f"{context}\n{line}"


def head_text(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text``, cut at a word when one ends near."""
    if len(text) <= chars:
        return text
    cut = text[:chars]
    space = cut.rfind(" ")
    return cut[:space] if space > chars // 2 else cut


def query_text(text: str, chars: int) -> str:
    """What of a question is embedded: all of it, or its head and its tail, ``chars // 2``
    characters each, cut at words when they end near (``RetrievalConfig.query_chars``)."""
    if len(text) <= chars:
        return text
    half = chars // 2
    tail = text[-half:]
    space = tail.find(" ")
    tail = tail[space + 1 :] if 0 <= space < half // 2 else tail
    return f"{head_text(text, half)} ... {tail}"


def _same_day(a: str | None, b: str | None) -> bool:
    """Whether two turn dates name the same day (two unreadable dates: if equal)."""
    if a == b:
        return True
    da, db = as_day(a), as_day(b)
    return da is not None and da == db


def _speaker_line(message: Message) -> str:
    """A message as one ``Speaker: content`` line (the name is not repeated)."""
    name = message.name or message.role.value
    content = message.content.strip()
    if content.startswith(f"{name}:"):
        return content
    return f"{name}: {content}"


class RetrievalMemory(Retriever):
    """Per-session turn memory plus shared document collections, for a Session.

    The session calls :meth:`remember_turns` with each completed turn and
    :meth:`retrieve` before planning a prompt, and passes :attr:`min_score` to the
    planner. One session never sees another's turns; collections given here (or attached
    with :meth:`attach`) are shared.

    Args:
        embedder: the text encoder (default :class:`~convo.embeddings.Embedder`, MiniLM,
            offline).
        collections: document collections every session can retrieve from.
        config: ranking settings (:class:`RetrievalConfig`).
        exact_max: see :class:`VectorIndex`. Default 20,000.

    Attributes:
        min_score: passages below this fused score are dropped by the planner.

    Example:
        >>> memory = RetrievalMemory(collections=[docs])                              # doctest: +SKIP
        >>> session = Session(engine=engine, retriever=memory, session_id="a")  # doctest: +SKIP
    """

    #: :meth:`retrieve` reads relative dates ("yesterday", "last week") against ``today=``.
    supports_today = True

    def __init__(
        self,
        embedder: TextEncoder | None = None,
        *,
        collections: Sequence[DocumentCollection] = (),
        config: RetrievalConfig | None = None,
        exact_max: int = DEFAULT_EXACT_MAX,
    ) -> None:
        self.embedder: TextEncoder = embedder if embedder is not None else Embedder()
        self.config = config or RetrievalConfig()
        self.min_score: float = self.config.min_score
        self.exact_max = exact_max
        self._shared: list[DocumentCollection] = list(collections)
        self._attached: dict[str, list[DocumentCollection]] = {}
        self._sessions: dict[str, UnitStore] = {}
        self._derived_of: dict[int, UnitFeatures] = {}
        self._vocab: dict[int, Vocabulary] = {}
        #: Word vectors, shared by every session's vocabulary (a word's vector does not
        #: depend on who said it).
        self._word_vectors: dict[str, np.ndarray] = {}

    # -- the two calls a Session makes -----------------------------------------------------
    def remember_turns(
        self,
        session_id: str,
        turns: Sequence[Turn],
        *,
        dates: Mapping[int, str] | None = None,
    ) -> None:
        """Index completed turns of ``session_id`` (a turn indexed again is replaced).

        Args:
            session_id: the owning session; only it will retrieve these turns.
            turns: completed turns. Each becomes one passage keyed ``turn_key(index)``
                whose text is ``[date]`` and one ``Speaker: content`` line per message.
            dates: optional date per turn index, shown in the passage.
        """
        store = self._store(session_id)
        items = []
        owns: list[str] = []  # each unit's own line, and the line it is read with ("": none)
        contexts: list[str] = []
        for turn, msgs, lines, day, ctx in self._turn_lines(store, turns, dates):
            head = f"[{day}]\n" if day and self.config.date_in_text else ""
            dense = (
                [_with_context(c, line) for c, line in zip(ctx, lines, strict=True)] if ctx else list(lines)
            )
            contexts += ctx or [""] * len(lines)
            owns += lines
            meta: dict[str, Any] = {
                "session_id": session_id,
                "turn": turn.index,
                "_lines": lines,
                "_speakers": [m.name or m.role.value for m in msgs],
            }
            if day:
                meta["date"] = day
            rec = Record(
                text=head + "\n".join(lines), source=f"turn {turn.index}", key=turn_key(turn.index), meta=meta
            )
            words = dense if self.config.context_words else list(lines)
            items.append((rec, words, words))
        alone = self.config.embed_alone and items
        store.add(items, vectors=self._unit_vectors(owns, contexts) if alone else None)
        if self.config.expand_terms > 0 and items:
            self._vocabulary(store, [t for _, texts, _ in items for text in texts for t in terms(text)])

    #: Each session's turns are searched by that session alone (see
    #: :class:`~convo.plan.PreparesTurns`).
    defer_window_turns = True

    def prepare_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        """Embed ahead, into the embedder's caches, what :meth:`remember_turns` will embed for
        ``turns`` (:meth:`embedding_texts`); index nothing. A :class:`~convo.session.Session`
        calls it in a background thread after each reply (see :mod:`convo.session.ahead`).
        Returns how many texts were embedded."""
        texts = self.embedding_texts(session_id, turns, dates=dates)
        if texts:
            self.embedder.encode(texts)
        return len(texts)

    def turns_ready(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        """0: a turn the window shows is indexed when it leaves it (this index lives in the
        process; see :class:`~convo.plan.PreparesTurns`)."""
        return 0

    def embedding_texts(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> list[str]:
        """The texts :meth:`remember_turns` would give the embedder for ``turns`` now (each
        line, the lines they are read with, and for query expansion every word not embedded
        yet), so that a caller can embed them ahead, off a turn's path, into the embedder's
        caches. Indexes nothing. (The vocabulary only takes words two messages use, known
        once the turns are indexed: every new word is listed.)"""
        store = self._sessions.get(session_id) or UnitStore(self.embedder, exact_max=1, nprobe=1)
        cfg = self.config
        texts: list[str] = []
        words: list[str] = []
        for _, _, lines, _, ctx in self._turn_lines(store, turns, dates):
            ctx = ctx or [""] * len(lines)
            dense = [_with_context(c, line) if c else line for c, line in zip(ctx, lines, strict=True)]
            if cfg.embed_alone:
                texts += [head_text(t, cfg.embed_chars) for t in lines]
                texts += [head_text(c, cfg.embed_chars) for c in ctx if c and cfg.context_weight > 0]
            else:
                texts += dense if cfg.context_words else lines
            if cfg.expand_terms > 0:
                words += [t for text in (dense if cfg.context_words else lines) for t in terms(text)]
        fresh = [w for w in dict.fromkeys(words) if w not in self._word_vectors and not w.isdigit()]
        return list(dict.fromkeys([*texts, *fresh]))

    def _turn_lines(
        self, store: UnitStore, turns: Sequence[Turn], dates: Mapping[int, str] | None
    ) -> Iterator[tuple[Turn, list[Message], list[str], str | None, list[str]]]:
        """Each turn with text: its messages, their ``Speaker: content`` lines, its date
        and (with ``neighbours``) the line each line is read with, else ``[]``."""
        last_lines: dict[int, str] = {}  # of these turns: not in the store yet
        last_dates: dict[int, str | None] = {}
        for turn in turns:
            msgs = [m for m in turn.messages if m.content.strip()]
            if not msgs:
                continue
            lines = [_speaker_line(m) for m in msgs]
            last_lines[turn.index] = lines[-1]
            date = (dates or {}).get(turn.index)
            last_dates[turn.index] = date
            ctx: list[str] = []
            if self.config.neighbours:
                # A short reply ("Yes, last week!") is findable by what it answers.
                # The previous turn's last line (indexed with this one or before), if it
                # was said the same day: a new session's first message is not read
                # with the last reply of an earlier one.
                prev = ""
                if (turn.index - 1) in last_lines:
                    if _same_day(last_dates.get(turn.index - 1), date):
                        prev = last_lines[turn.index - 1]
                else:
                    prev = self._last_line(store, turn.index, date)
                ctx = [prev, *lines[:-1]]
            yield turn, msgs, lines, date, ctx

    def _unit_vectors(self, owns: Sequence[str], contexts: Sequence[str]) -> np.ndarray:
        """Each unit's vector: its own line's head (``embed_chars``) plus ``context_weight``
        times the vector of the line it is read with, normalized.

        Every line is embedded alone and once (a line is the next one's context too), so
        the context never crowds the line's own text out of its vector (issue 24), and an
        embedding cache keyed by text serves a line whatever precedes it.
        """
        cfg = self.config
        heads = [head_text(t, cfg.embed_chars) for t in owns]
        ctx = [head_text(t, cfg.embed_chars) if t and cfg.context_weight > 0 else "" for t in contexts]
        texts = list(dict.fromkeys([*heads, *(c for c in ctx if c)]))
        row = {t: i for i, t in enumerate(texts)}
        vecs = self.embedder.encode(texts)
        out = vecs[[row[h] for h in heads]].astype(np.float32, copy=True)
        has = [i for i, c in enumerate(ctx) if c]
        if has:
            out[has] += cfg.context_weight * vecs[[row[ctx[i]] for i in has]]
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return np.ascontiguousarray(out / np.where(norms > 0, norms, 1.0), dtype=np.float32)

    def retrieve(
        self, query: str, *, session_id: str, top_k: int, today: date | str | None = None
    ) -> list[Passage]:
        """Candidate passages for ``query``: this session's turns and its collections.

        Args:
            query: the question (usually the newest user message).
            session_id: whose turns to search.
            top_k: how many the planner will use at most; up to ``candidates_factor *
                top_k`` are returned so it can skip duplicates and turns in the window.
            today: the day the question is asked (a ``date``, a ``datetime`` or a date
                string :func:`convo.dates.parse_day` reads), from which relative phrases
                ("yesterday", "last week") count; ``None`` (default): only calendar
                dates in the question are read. A :class:`~convo.session.Session` with a
                ``clock`` passes the date of the turn that asks.

        Returns:
            Passages, best first (``score`` is the fused score; ``meta`` holds the cosine,
            the BM25 score and the turn or document position).
        """
        if top_k <= 0 or not query.strip():
            return []
        with one_blas_thread():  # small products: more BLAS threads only wait (issue 24)
            return self._retrieve(query, session_id, top_k, today)

    def _retrieve(self, query: str, session_id: str, top_k: int, today: date | str | None) -> list[Passage]:
        n = top_k * self.config.candidates_factor
        sources = [s for s in [self._sessions.get(session_id)] if s is not None and len(s)]
        colls = [*self._shared, *self._attached.get(session_id, [])]
        if not sources and not any(len(c) for c in colls):
            return []
        vectors: dict[str, np.ndarray] = {}
        asked_on = as_day(today)

        def vector(text: str) -> np.ndarray:
            if text not in vectors:
                vectors[text] = self.embedder.encode([query_text(text, self.config.query_chars)])[0]
            return vectors[text]

        found: list[Passage] = []
        for store in sources:
            named = self._named_speakers(store, query) if self.config.speaker_boost > 0 else set()
            text = strip_names(query, named) if self.config.strip_names else query
            found.extend(self._search_turns(store, vector(text), text, n, named, query, asked_on))
        seen_colls: set[int] = set()
        for coll in colls:
            if id(coll) in seen_colls:
                continue
            seen_colls.add(id(coll))
            found.extend(coll.search(query, n, query_vector=vector(query)))
        found.sort(key=lambda p: -p.score)
        return found[:n]

    # -- management --------------------------------------------------------------------------
    def attach(self, collection: DocumentCollection, *, session_id: str | None = None) -> None:
        """Make ``collection`` retrievable by every session, or by ``session_id`` only."""
        target = self._shared if session_id is None else self._attached.setdefault(session_id, [])
        if all(c is not collection for c in target):
            target.append(collection)

    def forget_session(self, session_id: str) -> None:
        """Drop every turn of ``session_id`` (shared collections are kept)."""
        store = self._sessions.pop(session_id, None)
        self._attached.pop(session_id, None)
        if store is not None:  # a new store may get the old one's id: drop what was derived
            self._vocab.pop(id(store), None)
            self._derived_of.pop(id(store), None)

    def forget_turns(self, session_id: str, indices: Iterable[int]) -> int:
        """Drop some turns of a session. Returns how many were indexed."""
        store = self._sessions.get(session_id)
        if store is None:
            return 0
        n = 0
        for i in indices:
            pid = store.by_key.get(turn_key(i))
            if pid is not None:
                n += store.remove(pid)
        return n

    def session_ids(self) -> list[str]:
        """Sessions with indexed turns."""
        return sorted(self._sessions)

    def turn_count(self, session_id: str) -> int:
        """How many turns of ``session_id`` are indexed."""
        store = self._sessions.get(session_id)
        return len(store) if store is not None else 0

    def vocabulary(self, session_id: str) -> list[str]:
        """The words of ``session_id``'s expansion vocabulary (words two or more of its
        messages use; built on first use, saved with the session), in the order they were
        added; ``[]`` for a session with no turns."""
        store = self._sessions.get(session_id)
        return list(self._vocabulary(store).terms) if store is not None else []

    def expansion(self, query: str, *, session_id: str) -> list[str]:
        """The words query expansion adds to the second hop's word search for ``query`` in
        ``session_id``'s turns (see ``expand_terms`` and ``expand_query_words`` of
        :class:`RetrievalConfig`): what :meth:`retrieve` looks for besides the query's own
        words (it asks with the names of the speakers the query names taken out, see
        ``strip_names``; here ``query`` is used as given). ``[]`` for a session with no
        turns."""
        store = self._sessions.get(session_id)
        if store is None or not query.strip():
            return []
        vector = self.embedder.encode([query_text(query, self.config.query_chars)])[0]
        return self._expansion(store, query, vector)

    def _store(self, session_id: str) -> UnitStore:
        if not isinstance(session_id, str) or not session_id:
            raise ConfigError("session_id must be a non-empty string")
        store = self._sessions.get(session_id)
        if store is None:
            store = UnitStore(self.embedder, exact_max=self.exact_max, nprobe=DEFAULT_NPROBE)
            self._sessions[session_id] = store
        return store

    def _search_turns(
        self,
        store: UnitStore,
        qvec: np.ndarray,
        query: str,
        n: int,
        named: set[str],
        asked: str = "",
        today: date | None = None,
    ) -> list[Passage]:
        """The best ``n`` passages of one session's turns (see :class:`RetrievalConfig`).

        Every message is scored (dense + BM25), then: raised when its speaker is named in
        the query; mixed with the scores of a second query built from the first hits;
        raised by its episode's score; re-ranked for diversity; and offered as a line (or
        its whole turn, or its best line per turn).
        """
        cfg = self.config
        found = rank_units(
            store,
            self._derived(store),
            qvec,
            query,
            n,
            named,
            cfg,
            asked=asked,
            today=today,
            expansion=lambda text, vec: self._expansion(store, text, vec),
        )
        if found is None:
            return []
        dense, lexical = found.dense, found.lexical
        if cfg.turn_lines != "each":
            fused = found.scores.as_dict()
            return [self._turn_passage(store.records[h.pid], h) for h in store.hits(fused, dense, lexical, n)]
        ids = found.scores.ids()
        ranked = top_of(ids, found.scores.value[ids], max(n, 1) * 2)
        fused = dict(zip(ranked, found.scores.value[ranked].tolist(), strict=True))
        if cfg.mmr_lambda > 0 and store.vectors is not None:
            ranked, fused = mmr(ranked, fused, store.vectors.vectors(ranked), cfg.mmr_lambda)
        out: list[Passage] = []
        seen: set[int] = set()
        for u in ranked:
            group = [u, *self._adjacent(store, u, cfg.expand_lines)]
            for v in group:
                if v in seen:
                    continue
                seen.add(v)
                out.append(self._line_passage(store, v, fused[u], dense.get(v), lexical.get(v, 0.0)))
            if len(out) >= n:
                break
        return out[:n]

    def _line_passage(
        self, store: UnitStore, uid: int, score: float, cosine: float | None, bm25: float
    ) -> Passage:
        """One message of a turn as a passage, keyed ``turn_key(turn, line)``."""
        pid = store.unit_owner[uid]
        rec = store.records[pid]
        pos = rec.units.index(uid)
        lines: list[str] = rec.meta.get("_lines") or [rec.text]
        line = lines[pos] if pos < len(lines) else rec.text
        meta = {k: v for k, v in rec.meta.items() if not k.startswith("_")}
        meta.update(line=pos, cosine=None if cosine is None else round(cosine, 4), bm25=round(bm25, 4))
        date = rec.meta.get("date")
        text = line
        if date and self.config.date_in_text:
            if self.config.group_passages:
                meta["group"] = _day_label(str(date))
            else:
                text = f"[{date}]\n{line}"
        turn = int(rec.meta.get("turn", 0))
        return Passage(
            text=text, score=float(score), source=f"turn {turn}", key=turn_key(turn, pos), meta=meta
        )

    def _derived(self, store: UnitStore) -> UnitFeatures:
        """What the ranking reads per unit of ``store``, up to date (see :class:`UnitFeatures`)."""
        derived = self._derived_of.get(id(store)) or UnitFeatures(self.config.episode_turns)
        derived = self._derived_of[id(store)] = derived.update(store)
        return derived

    def _named_speakers(self, store: UnitStore, query: str) -> set[str]:
        """Speakers of ``store`` whose name (any word of it) appears in ``query``."""
        words = set(WORD.findall(query.lower()))
        names = self._derived(store).speakers
        return {sp for sp in names if set(WORD.findall(sp.lower())) & words}

    def _vocabulary(self, store: UnitStore, new_terms: Iterable[str] | None = None) -> Vocabulary:
        """The store's expansion vocabulary: words two or more of its messages use. Built
        on first use from every indexed word, then extended by :meth:`remember_turns`
        with the words it indexed (``new_terms``). Words of forgotten turns stay (the
        expansion skips words no message uses any more)."""
        vocab = self._vocab.get(id(store))
        if vocab is None:
            vocab = self._vocab[id(store)] = Vocabulary(self.embedder.dim)
            new_terms = store.lexical.indexed_terms()
        df = store.lexical.document_frequency
        fresh = [
            t
            for t in dict.fromkeys(new_terms or ())
            if t not in vocab.index and not t.isdigit() and df(t) >= 2
        ]
        missing = [t for t in fresh if t not in self._word_vectors]
        if missing:
            self._word_vectors.update(zip(missing, self.embedder.encode(missing), strict=True))
        if fresh:
            vocab.add(fresh, np.stack([self._word_vectors[t] for t in fresh]))
        return vocab

    def _expansion(self, store: UnitStore, query: str, qvec: np.ndarray | None = None) -> list[str]:
        """Words of the session's vocabulary nearest to the query's words, then to the
        query's vector ``qvec`` (see :func:`~convo.retrieval.expansion.expansion_words`)."""
        return expansion_words(self._vocabulary(store), store.lexical, query, qvec, self.config)

    @staticmethod
    def _adjacent(store: UnitStore, uid: int, width: int) -> list[int]:
        """The units up to ``width`` messages before and after ``uid`` in the conversation."""
        if width <= 0:
            return []
        rec = store.records[store.unit_owner[uid]]
        turn = int(rec.meta.get("turn", 0))
        pos = rec.units.index(uid)
        out: list[int] = []
        for step in (-1, 1):
            t, p = turn, pos
            for _ in range(width):
                p += step
                units = store.records[store.by_key[turn_key(t)]].units if turn_key(t) in store.by_key else []
                if not 0 <= p < len(units):
                    t += step
                    pid = store.by_key.get(turn_key(t))
                    if pid is None:
                        break
                    units = store.records[pid].units
                    p = len(units) - 1 if step < 0 else 0
                    if not units:
                        break
                out.append(units[p])
        return out

    def _turn_passage(self, rec: Record, hit: Hit) -> Passage:
        """A turn as a passage: the whole turn, or only its best-matching line(s)."""
        lines: list[str] = rec.meta.get("_lines") or []
        if self.config.turn_lines == "all" or len(lines) <= 1:
            return passage_of(rec, hit)
        keep = lines[max(0, hit.unit - self.config.context_lines) : hit.unit + 1]
        date = rec.meta.get("date")
        head = f"[{date}]\n" if date and self.config.date_in_text else ""
        return passage_of(rec, hit, head + "\n".join(keep))

    @staticmethod
    def _last_line(store: UnitStore, index: int, date: str | None = None) -> str:
        """The last line of turn ``index - 1`` if it was said on the day of ``date``."""
        pid = store.by_key.get(turn_key(index - 1))
        if pid is None or not _same_day(store.records[pid].meta.get("date"), date):
            return ""
        lines = store.records[pid].meta.get("_lines") or []
        return str(lines[-1]) if lines else ""

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every session's turns and the shared collections under folder ``path``.

        Each file is written atomically; the manifest ``memory.json`` is written last, so
        a crash mid-save leaves the previous manifest pointing at complete files of the
        previous save only if the folder is not reused; save to a fresh folder and
        :func:`os.replace` it for an all-or-nothing update.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        sessions = {}
        for sid, store in self._sessions.items():
            sub = "s-" + hashlib.sha1(sid.encode("utf-8")).hexdigest()[:16]
            store.save(folder / "sessions" / sub, owner=_owner(sid))
            vocab = self._vocab.get(id(store))
            if vocab is not None:
                vocab.save(folder / "sessions" / sub / "vocabulary.npz", owner=_owner(sid))
            sessions[sid] = sub
        collections = {}
        for coll in self._shared:
            sub = "c-" + hashlib.sha1(coll.name.encode("utf-8")).hexdigest()[:16]
            coll.save(folder / "collections" / sub)
            collections[coll.name] = sub
        write_json(
            folder / "memory.json",
            {
                "format": FORMAT,
                "config": self.config.to_dict(),
                "min_score": self.min_score,
                "exact_max": self.exact_max,
                "sessions": sessions,
                "collections": collections,
            },
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        embedder: TextEncoder | None = None,
        counter: TokenCounter | None = None,
    ) -> RetrievalMemory:
        """Read a memory written by :meth:`save` (the embedder must be the same model).

        What is read is checked, not trusted: the folders ``memory.json`` names must be
        plain names inside ``path``; each session's files must be that session's (its
        recorded owner, and the session id of every turn); ids must not clash. A
        vocabulary that does not fit is rebuilt from the session's words on first use.

        Raises:
            StoreError: a file is missing, damaged or another session's; the message
                says what to do.
        """
        folder = Path(path)
        meta_path = folder / "memory.json"
        meta = read_json(meta_path)
        try:
            if not isinstance(meta, dict):
                raise TypeError(f"expected a JSON object, got {type(meta).__name__}")
            if meta["format"] != FORMAT:
                raise ValueError(f"unknown format {meta['format']!r}")
            config = RetrievalConfig(**meta["config"])
            exact_max, min_score = int(meta["exact_max"]), float(meta["min_score"])
            sessions, collections = dict(meta["sessions"]), dict(meta["collections"])
            if not all(isinstance(k, str) and k for k in [*sessions, *collections]):
                raise TypeError("a session id or collection name is not a non-empty string")
        except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
            raise damaged(meta_path, f"the file is damaged ({exc!r})") from exc
        out = cls(embedder, config=config, exact_max=exact_max)
        out.min_score = min_score
        for sid, sub in sessions.items():
            sub_folder = child_folder(folder / "sessions", sub)
            store = UnitStore.load(
                sub_folder, out.embedder, exact_max=out.exact_max, nprobe=DEFAULT_NPROBE, owner=_owner(sid)
            )
            strangers = {rec.meta.get("session_id") for rec in store.records.values()} - {sid}
            if strangers:
                raise damaged(
                    sub_folder / "passages.json",
                    f"it holds turns of session {sorted(map(str, strangers))[0]!r}, not of session {sid!r}",
                )
            out._sessions[sid] = store
            vocab = Vocabulary.load(sub_folder / "vocabulary.npz", out.embedder.dim, owner=_owner(sid))
            if vocab is not None:  # else rebuilt on first use
                out._vocab[id(store)] = vocab
                out._word_vectors.update(zip(vocab.terms, vocab.vectors(), strict=True))
        for name, sub in collections.items():
            sub_folder = child_folder(folder / "collections", sub)
            coll = DocumentCollection.load(sub_folder, embedder=out.embedder, counter=counter)
            if coll.name != name:
                raise damaged(sub_folder, f"it holds collection {coll.name!r}, not {name!r}")
            out._shared.append(coll)
        return out
