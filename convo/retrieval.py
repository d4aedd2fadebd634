"""Retrieval memory: turns and documents found again when a later question needs them.

A :class:`RetrievalMemory` is what a session retrieves from. It holds, per session id, the
completed turns of that session, and it can see shared :class:`DocumentCollection` objects.
Each store keeps two indexes over the same *units* (a message of a turn, a chunk of a
document):

::

    query ──┬── Embedder ── VectorIndex (FAISS, inner product) ──┐
            │                                                    ├─ fuse ─ max per passage ─┐
            └── terms ───── BM25Index ───────────────────────────┘                          │
                                                                                            ▼
        Passage(text, score, source, key=turn_key(i) | "doc:...")  best first, ~3 x top_k

Fusion is a score mix by default: ``dense_weight * cosine + (1 - dense_weight) * bm25 /
(bm25 + bm25_half)``; reciprocal-rank fusion is available. Retrieval returns more
candidates than ``top_k``: the planner (:func:`convo.plan.plan_prompt`) drops those
already in the window, duplicates and low scores, then caps by ``retrieval_top_k`` and
``retrieval_tokens``.

A session's turns are searched message by message, for questions whose answer is spread
over several turns (all :class:`RetrievalConfig` options, measured on LoCoMo by
``benchmarks/locomo.py``)::

    fused message scores
      + second hop: the first hits' rarest words (names, places) and mean vector
      + episode: the query against the mean vector of the message's day
      + time: the query names days ("in June 2023"): messages of those days gain
      + neighbours: a share of the better adjacent message's score (a reply that
        matches lifts the line it answers, and the other way round)
      + content: a small prior for messages with more content words
      + speaker: the query names who said it (the name itself is taken out of the query)
      -> best messages, each a passage keyed turn_key(turn, line), tagged with its day

The planner puts every retrieved message into one memory message, under one short label
per day (:func:`day_label`), so a passage costs about its own line instead of a whole turn
with its date.

Isolation: a session only ever searches its own turns plus the collections attached to
all sessions or to it. Persistence uses FAISS's own file format and JSON, each file
written to a temporary name and moved into place with :func:`os.replace` (no pickle).

faiss and sentence-transformers are imported lazily; without them a
:class:`~convo.errors.MissingDependency` names ``pip install 'convo[retrieval]'``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import io
import json
import math
import os
import re
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np

from convo.dates import parse_day, time_spans
from convo.embeddings import Embedder, TextEncoder
from convo.errors import ConfigError, MissingDependency, StoreError
from convo.messages import Message
from convo.plan import Passage, Turn, turn_key
from convo.tokens import TokenCounter

__all__ = [
    "BM25Index",
    "Chunk",
    "DocumentCollection",
    "Fusion",
    "RetrievalConfig",
    "RetrievalMemory",
    "VectorIndex",
    "chunk_text",
    "day_label",
]


#: Above this many vectors a :class:`VectorIndex` becomes approximate (IVF). Exact search
#: over 20,000 MiniLM vectors takes about a millisecond per query on one core.
DEFAULT_EXACT_MAX = 20_000
#: IVF lists probed per query (of about sqrt(n) lists).
DEFAULT_NPROBE = 16
#: Document chunk size and overlap, in tokens of the collection's counter.
DEFAULT_CHUNK_TOKENS = 200
DEFAULT_OVERLAP_TOKENS = 40
#: Nearest words each vocabulary word keeps for query expansion (at least
#: ``RetrievalConfig.expand_terms``; the spare ones stand in for words grown too common).
NEAR_KEPT = 8

_FORMAT = 1


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise MissingDependency("faiss is not installed; run: pip install 'convo[retrieval]'") from None
    return faiss


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_json(path: Path, obj: Any) -> None:
    _write_atomic(path, json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read {path}: {exc}") from exc


# ---------------------------------------------------------------------------------------
# Vector index
# ---------------------------------------------------------------------------------------


class VectorIndex:
    """Inner-product FAISS index with stable int64 ids: exact, then approximate when large.

    Up to ``exact_max`` vectors it is an ``IndexIDMap2`` over ``IndexFlatIP`` (exact). When
    an :meth:`add` takes it past ``exact_max`` it is rebuilt once as an ``IndexIVFFlat``
    (inner product, about ``sqrt(n)`` lists trained on the vectors it holds, ``nprobe``
    lists searched per query). IVF was chosen over HNSW because it deletes natively. With
    normalized vectors the scores are cosine similarities.

    Args:
        dim: vector length.
        exact_max: the most vectors kept in the exact index. Default 20,000.
        nprobe: IVF lists searched per query once approximate. Default 16.

    Raises:
        ConfigError: ``dim < 1``, ``exact_max < 1`` or ``nprobe < 1``.

    Example:
        >>> index = VectorIndex(384)                              # doctest: +SKIP
        >>> index.add([7], vectors)                               # doctest: +SKIP
        >>> scores, ids = index.search(queries, k=5)              # doctest: +SKIP
    """

    def __init__(self, dim: int, *, exact_max: int = DEFAULT_EXACT_MAX, nprobe: int = DEFAULT_NPROBE) -> None:
        for name, value in (("dim", dim), ("exact_max", exact_max), ("nprobe", nprobe)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"VectorIndex.{name} must be an int >= 1, got {value!r}")
        faiss = _faiss()
        self.dim = dim
        self.exact_max = exact_max
        self.nprobe = nprobe
        self._index: Any = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._ids: set[int] = set()
        # A copy of every vector by id: the second retrieval hop and MMR read stored
        # vectors, and an IVF index cannot hand them back by id.
        self._vecs: dict[int, np.ndarray] = {}

    @property
    def kind(self) -> str:
        """``"flat"`` (exact) or ``"ivf"`` (approximate)."""
        return "flat" if isinstance(self._index, _faiss().IndexIDMap2) else "ivf"

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, vid: object) -> bool:
        return vid in self._ids

    def _check(self, vectors: np.ndarray) -> np.ndarray:
        arr = np.ascontiguousarray(vectors, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[1] != self.dim:
            raise ConfigError(f"expected vectors of shape (n, {self.dim}), got {arr.shape}")
        return arr

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add (or replace) vectors under ``ids``.

        Args:
            ids: one int id per row; an id already present is replaced.
            vectors: ``(len(ids), dim)`` array, normalized for cosine scores.
        """
        arr = self._check(vectors)
        id_arr = np.asarray(list(ids), dtype=np.int64)
        if len(id_arr) != len(arr):
            raise ConfigError(f"{len(id_arr)} ids for {len(arr)} vectors")
        if len(set(id_arr.tolist())) != len(id_arr):
            raise ConfigError("duplicate ids in one add()")
        if not len(arr):
            return
        self.remove([i for i in id_arr.tolist() if i in self._ids])
        if self.kind == "flat" and len(self._ids) + len(arr) > self.exact_max:
            old_ids, old_vecs = self._dump()
            self._build_ivf(np.concatenate([old_ids, id_arr]), np.concatenate([old_vecs, arr]))
        else:
            self._index.add_with_ids(arr, id_arr)
        self._ids.update(id_arr.tolist())
        self._vecs.update(zip(id_arr.tolist(), arr.copy(), strict=True))

    def _dump(self) -> tuple[np.ndarray, np.ndarray]:
        faiss = _faiss()
        n = self._index.ntotal
        ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        vecs = self._index.index.reconstruct_n(0, n) if n else np.zeros((0, self.dim), np.float32)
        return ids, np.asarray(vecs, dtype=np.float32)

    def _build_ivf(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        faiss = _faiss()
        nlist = max(1, min(int(math.sqrt(len(vecs))), len(vecs) // 39))
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vecs)
        index.nprobe = min(self.nprobe, nlist)
        index.add_with_ids(vecs, ids)
        self._quantizer = quantizer  # the IVF index does not own it: keep it alive
        self._index = index

    def remove(self, ids: Iterable[int]) -> int:
        """Remove ``ids`` (unknown ids are ignored). Returns how many were removed."""
        present = [int(i) for i in ids if int(i) in self._ids]
        if not present:
            return 0
        removed = int(self._index.remove_ids(np.asarray(present, dtype=np.int64)))
        self._ids.difference_update(present)
        for i in present:
            self._vecs.pop(i, None)
        return removed

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of ``ids`` as a ``(len(ids), dim)`` array.

        Raises:
            KeyError: an id is not in the index.
        """
        if not len(ids):
            return np.zeros((0, self.dim), np.float32)
        return np.stack([self._vecs[int(i)] for i in ids])

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best ids for each query row.

        Args:
            vectors: ``(m, dim)`` queries.
            k: results per query.

        Returns:
            ``(scores, ids)``, both ``(m, k')`` with ``k' = min(k, len(self))``, best first;
            an id of ``-1`` marks a missing result (possible with IVF).
        """
        arr = self._check(vectors)
        k = min(int(k), len(self._ids))
        if k <= 0:
            return np.zeros((len(arr), 0), np.float32), np.zeros((len(arr), 0), np.int64)
        scores, ids = self._index.search(arr, k)
        return scores, ids

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to ``path`` (FAISS format) and its settings to ``path.json``.

        Both files are written to temporary names and moved into place atomically.
        """
        faiss = _faiss()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            faiss.write_index(self._index, tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        meta = {
            "format": _FORMAT,
            "dim": self.dim,
            "exact_max": self.exact_max,
            "nprobe": self.nprobe,
            "kind": self.kind,
            "count": len(self),
        }
        _write_json(target.with_name(target.name + ".json"), meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> VectorIndex:
        """Read an index written by :meth:`save`.

        Raises:
            StoreError: the files are missing, unreadable or disagree with each other.
        """
        faiss = _faiss()
        target = Path(path)
        meta = _read_json(target.with_name(target.name + ".json"))
        try:
            raw = faiss.read_index(str(target))
        except Exception as exc:
            raise StoreError(f"cannot read FAISS index {target}: {exc}") from exc
        out = cls(int(meta["dim"]), exact_max=int(meta["exact_max"]), nprobe=int(meta["nprobe"]))
        # read_index returns the concrete, owning type; a downcast view would dangle.
        out._index = raw
        if meta["kind"] == "flat":
            ids, vecs = out._dump()
        else:
            raw.nprobe = min(out.nprobe, raw.nlist)
            invlists = raw.invlists
            lists = [i for i in range(raw.nlist) if invlists.list_size(i)]
            chunks = [faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy() for i in lists]
            # IVFFlat codes are the raw float32 vectors.
            codes = [
                faiss.rev_swig_ptr(invlists.get_codes(i), invlists.list_size(i) * raw.code_size)
                .copy()
                .view(np.float32)
                .reshape(-1, out.dim)
                for i in lists
            ]
            ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
            vecs = np.concatenate(codes) if codes else np.zeros((0, out.dim), np.float32)
        out._ids = {int(i) for i in ids}
        out._vecs = dict(zip((int(i) for i in ids), vecs, strict=True))
        if out._index.d != out.dim or len(out._ids) != int(meta["count"]):
            raise StoreError(f"{target}: index and metadata disagree; the save was partial")
        return out


# ---------------------------------------------------------------------------------------
# Lexical index
# ---------------------------------------------------------------------------------------

_STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we
    were what when where which while who whom why will with would you your yours yourself
    yourselves s t don ll m re ve d yes oh hey wow really also""".split()
)
_WORD = re.compile(r"[^\W_]+")


def _stem(word: str) -> str:
    # A light suffix stripper: enough to match "paint/painting/paints/painted".
    for suffix in ("ingly", "edly", "ing", "ies", "ied", "ed", "es", "ly", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            base = word[: -len(suffix)]
            if suffix in ("ies", "ied"):
                return base + "y"
            if suffix in ("ing", "ed") and len(base) >= 4 and base[-1] == base[-2]:
                return base[:-1]  # running -> run
            return base
    return word


def terms(text: str) -> list[str]:
    """The BM25 terms of ``text``: lowercase words, stopwords dropped, lightly stemmed."""
    return [_stem(w) for w in _WORD.findall(text.lower()) if w not in _STOPWORDS]


class BM25Index:
    """Okapi BM25 over an id -> text collection, with incremental add and remove.

    Args:
        k1: term-frequency saturation. Default 1.2.
        b: length normalization, 0 (none) to 1 (full). Default 0.75.

    Raises:
        ConfigError: ``k1 < 0`` or ``b`` outside [0, 1].
    """

    def __init__(self, *, k1: float = 1.2, b: float = 0.75) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ConfigError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1 = k1
        self.b = b
        self._postings: dict[str, dict[int, int]] = {}
        self._lengths: dict[int, int] = {}
        self._doc_terms: dict[int, list[str]] = {}
        self._total = 0
        # Per-term arrays (ids, term frequencies, document lengths) for vectorized
        # scoring, built on first use and dropped when the term's postings change.
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._lengths)

    def document_frequency(self, term: str) -> int:
        """How many indexed documents use ``term`` (a :func:`terms` form)."""
        return len(self._postings.get(term, ()))

    def indexed_terms(self) -> list[str]:
        """Every term some indexed document uses."""
        return list(self._postings)

    def add(self, doc_id: int, text: str) -> None:
        """Index ``text`` under ``doc_id`` (replacing what that id held)."""
        self.remove(doc_id)
        tf = Counter(terms(text))
        for term, n in tf.items():
            self._postings.setdefault(term, {})[doc_id] = n
            self._arrays.pop(term, None)
        length = sum(tf.values())
        self._lengths[doc_id] = length
        self._doc_terms[doc_id] = list(tf)
        self._total += length

    def remove(self, doc_id: int) -> bool:
        """Forget ``doc_id``. Returns whether it was indexed."""
        length = self._lengths.pop(doc_id, None)
        if length is None:
            return False
        self._total -= length
        for term in self._doc_terms.pop(doc_id, []):
            self._arrays.pop(term, None)
            postings = self._postings.get(term)
            if postings is None:
                continue
            postings.pop(doc_id, None)
            if not postings:
                del self._postings[term]
        return True

    def _term_arrays(self, term: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        postings = self._postings.get(term)
        if not postings:
            return None
        cached = self._arrays.get(term)
        if cached is None:
            ids = np.fromiter(postings.keys(), dtype=np.int64, count=len(postings))
            tfs = np.fromiter(postings.values(), dtype=np.float64, count=len(postings))
            lens = np.fromiter((self._lengths[i] for i in postings), dtype=np.float64, count=len(postings))
            cached = self._arrays[term] = (ids, tfs, lens)
        return cached

    def _score_arrays(self, query: str, extra_terms: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, scores)`` of every document sharing a term with the query."""
        n = len(self._lengths)
        empty = (np.zeros(0, np.int64), np.zeros(0, np.float64))
        if not n:
            return empty
        avg = self._total / n or 1.0
        all_ids, all_scores = [], []
        for term in sorted(set(terms(query)) | set(extra_terms)):
            arrays = self._term_arrays(term)
            if arrays is None:
                continue
            ids, tfs, lens = arrays
            df = len(ids)
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            norm = self.k1 * (1.0 - self.b + self.b * lens / avg)
            all_ids.append(ids)
            all_scores.append(idf * tfs * (self.k1 + 1.0) / (tfs + norm))
        if not all_ids:
            return empty
        if len(all_ids) == 1:
            return all_ids[0], all_scores[0]
        uniq, inverse = np.unique(np.concatenate(all_ids), return_inverse=True)
        return uniq, np.bincount(inverse, weights=np.concatenate(all_scores), minlength=len(uniq))

    def scores(self, query: str, extra_terms: Sequence[str] = ()) -> dict[int, float]:
        """BM25 score of every document sharing a term with ``query`` (others score 0).

        Args:
            query: the text; its :func:`terms` are searched.
            extra_terms: terms (already in :func:`terms` form) searched as well.
        """
        ids, scores = self._score_arrays(query, extra_terms)
        return dict(zip(ids.tolist(), scores.tolist(), strict=True))

    def search(self, query: str, k: int, extra_terms: Sequence[str] = ()) -> list[tuple[int, float]]:
        """The ``k`` best ``(id, score)`` pairs, best first (see :meth:`scores`)."""
        ids, scores = self._score_arrays(query, extra_terms)
        k = max(int(k), 0)
        if k < len(ids):
            top = np.argpartition(-scores, k - 1)[:k] if k else np.zeros(0, np.int64)
            ids, scores = ids[top], scores[top]
        order = np.lexsort((ids, -scores))
        return list(zip(ids[order].tolist(), scores[order].tolist(), strict=True))

    def rare_terms(self, texts: Iterable[str], n: int, *, exclude: Iterable[str] = ()) -> list[str]:
        """The ``n`` terms of ``texts`` that are rarest in the index (highest IDF), best first.

        Terms absent from the index, or seen in only one document (nothing else to find
        with them), and those in ``exclude`` are skipped.
        """
        skip = set(exclude)
        found = {t for text in texts for t in terms(text)} - skip
        df = {t: self.document_frequency(t) for t in found}
        ranked = sorted((t for t in found if df[t] > 1), key=lambda t: (df[t], t))
        return ranked[:n]


# ---------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------


class Fusion(enum.StrEnum):
    """How dense and lexical evidence are combined.

    ``DENSE`` and ``LEXICAL`` use one index only. ``MIX`` scores ``w * cosine + (1 - w) *
    bm25 / (bm25 + bm25_half)`` (both in [0, 1], so ``min_score`` keeps one meaning across
    queries). ``RRF`` is reciprocal-rank fusion, ``sum 1 / (rrf_k + rank)``, rescaled so
    that a unit ranked first by both indexes scores 1.
    """

    DENSE = "dense"
    LEXICAL = "lexical"
    MIX = "mix"
    RRF = "rrf"


#: The values of :attr:`RetrievalConfig.turn_lines`.
TURN_LINES = ("all", "best", "each")


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig:
    """How a :class:`RetrievalMemory` ranks candidates.

    Args:
        fusion: :class:`Fusion` or its name. Default ``"mix"``.
        dense_weight: weight of the cosine in ``MIX``, in [0, 1]. Default 0.5.
        bm25_half: the BM25 score that maps to 0.5 in ``MIX``. Default 6.0.
        rrf_k: the rank offset of ``RRF``. Default 60.
        candidates_factor: :meth:`RetrievalMemory.retrieve` returns up to ``candidates_factor *
            top_k`` passages, so the planner can skip duplicates. Default 3.
        unit_candidates: units fetched from each index before fusion (at least). Default
            256.
        min_score: passages scoring below this are dropped by the planner. Default 0.2.
        neighbours: also score each message of a turn with the previous message as
            context (a short reply is found by what it answers). Default True.
        date_in_text: prefix a turn passage with its date. Default True.
        turn_lines: what a passage of a turn holds. ``"all"``: the whole turn (one
            passage per turn). ``"best"``: the turn's best-matching message, with
            ``context_lines`` messages before it (one passage per turn). ``"each"``: every
            message is its own candidate, so two messages of one turn can both be
            recalled and a long turn does not cost its whole length. Default ``"each"``.
        context_lines: with ``"best"``, messages shown before the best one. Default 0.
        group_passages: tag line passages with their date (``meta["group"]``) so the
            planner packs the lines of one date under one header instead of repeating it
            per line. Default True.
        speaker_boost: added to the score of a message whose speaker is named in the
            query ("What did Maria ..." favours Maria's own messages). Default 0.25; 0
            turns it off.
        second_hop: weight, in [0, 1], of a second query built from the first hits: their
            rarest words added to the query's terms (names, places, things the question
            did not say), which may find new messages, and their mean vector added to the
            query's, which re-scores the messages found. Default 0.5; 0 skips
            it.
        strip_names: search the turns with the names of the speakers the query names
            taken out of it (the speaker boost already favours their messages, and a
            name alone matches every greeting that addresses that person). Default
            True.
        hop_seeds: first hits the second query is built from. Default 3.
        hop_terms: words taken from the first hits into the second query. Default 12.
        hop_distinct_days: take the first hits the second query is built from from
            different episodes (days): the pieces of a multi-hop answer are spread over
            days, and seeds from one day pull the second query back to it. Default True.
        episode_weight: weight of the score of the message's whole episode (the turns
            of one date; blocks of ``episode_turns`` turns without dates): its mean
            vector against the query, added to each message's score, so an episode about
            the topic lifts its messages. Default 0.2; 0 turns it off.
        episode_turns: turns per episode when turns carry no date. Default 16.
        mmr_lambda: diversity (maximal marginal relevance): a candidate's score is
            lowered by ``mmr_lambda`` times its highest cosine to a better candidate
            already chosen, so near-repeats make room for other evidence. Default 0.0; 0
            keeps the plain ranking.
        expand_lines: with ``"each"``, also offer the messages right before and after a
            hit (``expand_lines`` each side) as candidates just below it. Default 0.
        content_weight: a prior for messages that say something: added to a message's
            score times ``min(1, content words / content_terms)`` (its own words, not the
            context line's, stopwords left out), so "Thanks, see you!" yields to news
            that answers questions later. Default 0.05; 0 turns it off.
        content_terms: content words at which a message gets the whole
            ``content_weight``. Default 20.
        neighbour_weight: a message is raised by ``neighbour_weight`` times the score
            (above the lowest candidate's) of the better of the messages right before and
            after it in the conversation, so the line a matching reply answers ("Look at
            this!" before "What a lovely sunset painting!") is found with it; those
            neighbours become candidates too. Default 0.5; 0 turns it off.
        time_weight: time-aware scoring. When the query names days (``"on 3 June,
            2023"``, ``"in August 2023"``, ``"the first half of September 2022"``,
            ``"between August 11 and August 15 2023"``, ``"as of December 2023"``: see
            :func:`convo.dates.time_spans`), a message of a turn dated inside them gains
            ``time_weight``, one dated within ``time_grace_days`` of them a share
            falling linearly to 0. Relative phrases ("yesterday", "last week") count
            when :meth:`RetrievalMemory.retrieve` is told ``today``. Turns are dated by
            ``Session.add(..., date=...)`` or ``Session(clock=...)``
            (:func:`convo.dates.parse_day` reads the common forms); undated turns and
            queries that name no time are scored as before. Default 0.25; 0 turns it
            off.
        time_grace_days: days around the named ones over which the time gain fades out
            (a turn often tells of the week before). Default 14.
        time_candidates: when the named days hold at most this many messages, all of
            them become candidates (a question "on 25 May, 2022" finds that day's
            messages even when no word matches). Default 120; 0 never adds any.
        expand_terms: query expansion. Each word of the query that two or more of the
            session's messages use brings up to ``expand_terms`` words of the session's
            vocabulary whose embeddings (the same model, one word at a time) are nearest
            to it, at cosine ``expand_min_cosine`` or more, into the second hop's word
            search: "passionate" also finds "passion", "vacationed" "trip" and "travel",
            "food" "meal". The vocabulary's vectors and nearest words are kept up to date
            as turns are indexed, so a query only looks them up. Default 3; 0 turns it off.
        expand_min_cosine: how near a word must be to expand a query word. Default 0.6.
        expand_max_share: words used in more than this share of the session's messages
            are too common to be added. Default 0.05.
        expand_query_words: also up to this many words of the session's vocabulary
            nearest to the whole query's vector (at cosine ``expand_query_min_cosine``
            or more) join the second hop's word search: "What instruments does she
            play?" brings "music", "piano", "violin"; "What does she do to destress?"
            "therapy" and "comfort". Default 4; 0 turns it off.
        expand_query_min_cosine: how near a word must be to the query. Default 0.4.

    Raises:
        ConfigError: a value is out of range.
    """

    fusion: Fusion = Fusion.MIX
    dense_weight: float = 0.5
    bm25_half: float = 6.0
    rrf_k: int = 60
    candidates_factor: int = 3
    unit_candidates: int = 256
    min_score: float = 0.2
    neighbours: bool = True
    date_in_text: bool = True
    turn_lines: str = "each"
    context_lines: int = 0
    group_passages: bool = True
    speaker_boost: float = 0.25
    second_hop: float = 0.5
    hop_seeds: int = 3
    hop_terms: int = 12
    hop_distinct_days: bool = True
    episode_weight: float = 0.2
    episode_turns: int = 16
    strip_names: bool = True
    mmr_lambda: float = 0.0
    expand_lines: int = 0
    content_weight: float = 0.05
    content_terms: int = 20
    neighbour_weight: float = 0.5
    time_weight: float = 0.25
    time_grace_days: int = 14
    time_candidates: int = 120
    expand_terms: int = 3
    expand_min_cosine: float = 0.6
    expand_max_share: float = 0.05
    expand_query_words: int = 4
    expand_query_min_cosine: float = 0.4

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "fusion", Fusion(self.fusion))
        except ValueError:
            names = ", ".join(f.value for f in Fusion)
            raise ConfigError(f"fusion must be one of {names}, got {self.fusion!r}") from None
        if not 0.0 <= self.dense_weight <= 1.0:
            raise ConfigError(f"dense_weight must be in [0, 1], got {self.dense_weight}")
        if self.bm25_half <= 0:
            raise ConfigError(f"bm25_half must be > 0, got {self.bm25_half}")
        for name in (
            "rrf_k",
            "candidates_factor",
            "unit_candidates",
            "hop_seeds",
            "episode_turns",
            "content_terms",
            "time_grace_days",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in (
            "context_lines",
            "hop_terms",
            "expand_lines",
            "time_candidates",
            "expand_terms",
            "expand_query_words",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.turn_lines not in TURN_LINES:
            raise ConfigError(f"turn_lines must be one of {', '.join(TURN_LINES)}, got {self.turn_lines!r}")
        for name in (
            "speaker_boost",
            "episode_weight",
            "mmr_lambda",
            "content_weight",
            "neighbour_weight",
            "time_weight",
        ):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.second_hop <= 1.0:
            raise ConfigError(f"second_hop must be in [0, 1], got {self.second_hop}")
        for name in ("expand_min_cosine", "expand_query_min_cosine"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [-1, 1], got {getattr(self, name)!r}")
        if not 0.0 < self.expand_max_share <= 1.0:
            raise ConfigError(f"expand_max_share must be in (0, 1], got {self.expand_max_share}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe settings."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["fusion"] = self.fusion.value
        return out


# ---------------------------------------------------------------------------------------
# A store: passages, their units, and both indexes
# ---------------------------------------------------------------------------------------


def _fuse(
    dense: Mapping[int, float], lexical: Mapping[int, float], config: RetrievalConfig
) -> dict[int, float]:
    """One score per unit from its cosine and its BM25 score (see :class:`Fusion`)."""
    fused: dict[int, float] = {}
    if config.fusion is Fusion.RRF:
        scale = (config.rrf_k + 1) / 2
        for ranking in (dense, lexical):
            ordered = sorted(ranking, key=lambda u, r=ranking: -r[u])  # type: ignore[misc]
            for rank, uid in enumerate(ordered):
                fused[uid] = fused.get(uid, 0.0) + scale / (config.rrf_k + rank + 1)
    else:
        w = {Fusion.DENSE: 1.0, Fusion.LEXICAL: 0.0}.get(config.fusion, config.dense_weight)
        floor = min(dense.values()) if dense else 0.0
        for uid in dense.keys() | lexical.keys():
            lex = lexical.get(uid, 0.0)
            fused[uid] = w * dense.get(uid, floor) + (1.0 - w) * lex / (lex + config.bm25_half)
    return fused


@dataclass(kw_only=True)
class _Record:
    text: str
    source: str
    key: str
    meta: dict[str, Any] = field(default_factory=dict)
    units: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class _Hit:
    pid: int
    score: float
    unit: int  # position of the best unit in its passage
    cosine: float | None
    bm25: float


class _Store:
    """Passages split into index units; dense and BM25 indexes over the units."""

    def __init__(self, encoder: TextEncoder, *, exact_max: int, nprobe: int) -> None:
        self.encoder = encoder
        self.exact_max = exact_max
        self.nprobe = nprobe
        self.records: dict[int, _Record] = {}
        self.by_key: dict[str, int] = {}
        self.unit_owner: dict[int, int] = {}
        self.unit_text: dict[int, str] = {}
        self.unit_lex: dict[int, str] = {}
        self.lexical = BM25Index()
        self.vectors: VectorIndex | None = None
        self._next_pid = 0
        self._next_uid = 0
        self.version = 0  # bumped by every change, for caches derived from the store

    def __len__(self) -> int:
        return len(self.records)

    def add(self, items: Sequence[tuple[_Record, Sequence[str], Sequence[str]]]) -> list[int]:
        """Add passages. Each item: (record, dense unit texts, lexical unit texts)."""
        for rec, _, _ in items:
            if rec.key and rec.key in self.by_key:
                self.remove(self.by_key[rec.key])
        self.version += 1
        uids: list[int] = []
        dense_texts: list[str] = []
        pids = []
        for rec, dense, lexical in items:
            pid = self._next_pid
            self._next_pid += 1
            pids.append(pid)
            self.records[pid] = rec
            if rec.key:
                self.by_key[rec.key] = pid
            for d, lx in zip(dense, lexical, strict=True):
                uid = self._next_uid
                self._next_uid += 1
                rec.units.append(uid)
                self.unit_owner[uid] = pid
                self.unit_text[uid] = d
                self.unit_lex[uid] = lx
                self.lexical.add(uid, lx)
                uids.append(uid)
                dense_texts.append(d)
        if uids:
            vecs = self.encoder.encode(dense_texts)
            if self.vectors is None:
                self.vectors = VectorIndex(vecs.shape[1], exact_max=self.exact_max, nprobe=self.nprobe)
            self.vectors.add(uids, vecs)
        return pids

    def remove(self, pid: int) -> bool:
        rec = self.records.pop(pid, None)
        if rec is None:
            return False
        self.version += 1
        if rec.key and self.by_key.get(rec.key) == pid:
            del self.by_key[rec.key]
        for uid in rec.units:
            self.unit_owner.pop(uid, None)
            self.unit_text.pop(uid, None)
            self.unit_lex.pop(uid, None)
            self.lexical.remove(uid)
        if self.vectors is not None:
            self.vectors.remove(rec.units)
        return True

    def unit_scores(
        self, qvec: np.ndarray, query: str, k: int, config: RetrievalConfig, extra_terms: Sequence[str] = ()
    ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """``(fused, cosine, bm25)`` per unit for the best ``k`` units of each index."""
        dense: dict[int, float] = {}
        if config.fusion is not Fusion.LEXICAL and self.vectors is not None:
            scores, ids = self.vectors.search(qvec[None, :], k)
            dense = {int(u): float(s) for s, u in zip(scores[0], ids[0], strict=True) if u >= 0}
        lexical: dict[int, float] = {}
        if config.fusion is not Fusion.DENSE:
            lexical = dict(self.lexical.search(query, k, extra_terms))
        return _fuse(dense, lexical, config), dense, lexical

    def hits(
        self, fused: Mapping[int, float], dense: Mapping[int, float], lexical: Mapping[int, float], n: int
    ) -> list[_Hit]:
        """The best ``n`` passages by unit scores, best first; a passage scores as its best unit."""
        best: dict[int, _Hit] = {}
        for uid, score in fused.items():
            pid = self.unit_owner[uid]
            hit = best.get(pid)
            if hit is None or score > hit.score:
                best[pid] = _Hit(
                    pid=pid,
                    score=score,
                    unit=self.records[pid].units.index(uid),
                    cosine=dense.get(uid),
                    bm25=lexical.get(uid, 0.0),
                )
        return sorted(best.values(), key=lambda h: (-h.score, h.pid))[:n]

    def search(self, qvec: np.ndarray, query: str, n: int, config: RetrievalConfig) -> list[_Hit]:
        """The best ``n`` passages, best first; a passage scores as its best unit."""
        if not self.records:
            return []
        fused, dense, lexical = self.unit_scores(qvec, query, max(config.unit_candidates, 4 * n), config)
        return self.hits(fused, dense, lexical, n)

    # -- persistence ------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.vectors is not None:
            self.vectors.save(folder / "vectors.faiss")
        data = {
            "format": _FORMAT,
            "next_pid": self._next_pid,
            "next_uid": self._next_uid,
            "has_vectors": self.vectors is not None,
            "records": [
                {
                    "pid": pid,
                    "text": r.text,
                    "source": r.source,
                    "key": r.key,
                    "meta": r.meta,
                    "units": [[u, self.unit_text[u], self.unit_lex[u]] for u in r.units],
                }
                for pid, r in self.records.items()
            ],
        }
        _write_json(folder / "passages.json", data)

    @classmethod
    def load(cls, folder: Path, encoder: TextEncoder, *, exact_max: int, nprobe: int) -> _Store:
        data = _read_json(folder / "passages.json")
        store = cls(encoder, exact_max=exact_max, nprobe=nprobe)
        store._next_pid = int(data["next_pid"])
        store._next_uid = int(data["next_uid"])
        for item in data["records"]:
            rec = _Record(text=item["text"], source=item["source"], key=item["key"], meta=item["meta"])
            pid = int(item["pid"])
            store.records[pid] = rec
            if rec.key:
                store.by_key[rec.key] = pid
            for uid, text, lx in item["units"]:
                rec.units.append(int(uid))
                store.unit_owner[int(uid)] = pid
                store.unit_text[int(uid)] = text
                store.unit_lex[int(uid)] = lx
                store.lexical.add(int(uid), lx)
        if data["has_vectors"]:
            store.vectors = VectorIndex.load(folder / "vectors.faiss")
            if set(store.unit_owner) != store.vectors._ids:
                raise StoreError(f"{folder}: vectors and passages disagree; the save was partial")
        return store


# ---------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """A piece of a document, with where it came from.

    Attributes:
        text: the chunk text (decoded from its tokens).
        source: the document's name (a file path or a label).
        start_token: index of its first token in the document's token sequence.
        end_token: one past its last token.
        heading: the nearest Markdown heading above it (``""`` if none).
    """

    text: str
    source: str
    start_token: int
    end_token: int
    heading: str = ""

    @property
    def citation(self) -> str:
        """``"source:start-end"`` (token positions)."""
        return f"{self.source}:{self.start_token}-{self.end_token}"


_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def chunk_text(
    text: str,
    counter: TokenCounter,
    *,
    source: str = "",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
) -> list[Chunk]:
    """Cut ``text`` into chunks of ``chunk_tokens`` tokens, consecutive chunks sharing
    ``overlap_tokens`` tokens.

    Args:
        text: the document.
        counter: its ``encode``/``decode`` define the tokens.
        source: the document's name, kept for citation.
        chunk_tokens: tokens per chunk (the last may be shorter). Default 200.
        overlap_tokens: tokens repeated at the start of the next chunk. Default 40.

    Returns:
        Chunks in document order; ``chunks[i].start_token == i * (chunk_tokens -
        overlap_tokens)``.

    Raises:
        ConfigError: ``chunk_tokens < 1`` or ``overlap_tokens`` not in ``[0, chunk_tokens)``.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if not isinstance(overlap_tokens, int) or not 0 <= overlap_tokens < chunk_tokens:
        raise ConfigError(
            f"overlap_tokens must be in [0, chunk_tokens={chunk_tokens}), got {overlap_tokens!r}"
        )
    ids = counter.encode(text)
    headings: list[tuple[int, str]] = []
    for m in _HEADING.finditer(text):
        headings.append((len(counter.encode(text[: m.start()])), m.group(1)))
    step = chunk_tokens - overlap_tokens
    out: list[Chunk] = []
    start = 0
    while start < len(ids):
        end = min(start + chunk_tokens, len(ids))
        heading = ""
        for pos, title in headings:
            if pos <= start:
                heading = title
            else:
                break
        out.append(
            Chunk(
                text=counter.decode(ids[start:end]),
                source=source,
                start_token=start,
                end_token=end,
                heading=heading,
            )
        )
        if end == len(ids):
            break
        start += step
    return out


class DocumentCollection:
    """A named, shareable collection of document chunks, searchable by meaning and words.

    Attach it to a :class:`RetrievalMemory` (for every session, or one session) to make it
    retrievable; one collection can serve many memories and sessions.

    Args:
        name: the collection's name (also its key prefix: ``"doc:<name>:..."``).
        embedder: the text encoder (default :class:`~convo.embeddings.Embedder`).
        counter: the token counter used for chunking (default cl100k via tiktoken).
        chunk_tokens: tokens per chunk. Default 200.
        overlap_tokens: tokens shared by consecutive chunks. Default 40.
        exact_max: see :class:`VectorIndex`. Default 20,000.

    Example:
        >>> docs = DocumentCollection("manual", embedder=Embedder())      # doctest: +SKIP
        >>> docs.add_file("README.md")                                    # doctest: +SKIP
        >>> docs.search("how do I install it", k=3)[0].source             # doctest: +SKIP
        'README.md:0-200'
    """

    def __init__(
        self,
        name: str,
        *,
        embedder: TextEncoder | None = None,
        counter: TokenCounter | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
        exact_max: int = DEFAULT_EXACT_MAX,
        config: RetrievalConfig | None = None,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError("a DocumentCollection needs a non-empty name")
        chunk_text("", _NullCounter(), chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
        self.name = name
        self.embedder: TextEncoder = embedder if embedder is not None else Embedder()
        self._counter = counter
        self.chunk_tokens = chunk_tokens
        self.overlap_tokens = overlap_tokens
        self.config = config or RetrievalConfig()
        self._store = _Store(self.embedder, exact_max=exact_max, nprobe=DEFAULT_NPROBE)

    @property
    def counter(self) -> TokenCounter:
        """The chunking counter (cl100k by default, loaded on first use)."""
        if self._counter is None:
            from convo.tokens import TiktokenCounter

            self._counter = TiktokenCounter("cl100k_base")
        return self._counter

    def __len__(self) -> int:
        return len(self._store)

    def add_text(self, text: str, *, source: str) -> list[Chunk]:
        """Chunk ``text`` and index the chunks (replacing an earlier text of ``source``).

        Args:
            text: plain text or Markdown.
            source: its name for citations; re-adding the same source replaces it.

        Returns:
            The chunks indexed.
        """
        if not source:
            raise ConfigError("add_text needs a source name for citations")
        self.remove_source(source)
        chunks = chunk_text(
            text,
            self.counter,
            source=source,
            chunk_tokens=self.chunk_tokens,
            overlap_tokens=self.overlap_tokens,
        )
        items = []
        for c in chunks:
            key = f"doc:{self.name}:{c.citation}"
            unit = f"{c.heading}\n{c.text}" if c.heading else c.text
            meta = {
                "collection": self.name,
                "document": source,
                "start_token": c.start_token,
                "end_token": c.end_token,
                "heading": c.heading,
            }
            items.append((_Record(text=c.text, source=c.citation, key=key, meta=meta), [unit], [unit]))
        self._store.add(items)
        return chunks

    def add_file(self, path: str | os.PathLike[str], *, source: str | None = None) -> list[Chunk]:
        """Read a UTF-8 text or Markdown file and :meth:`add_text` it.

        Args:
            path: the file.
            source: its citation name (default: the path as given).
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise StoreError(f"cannot read {p}: {exc}") from exc
        return self.add_text(text, source=source or str(path))

    def remove_source(self, source: str) -> int:
        """Remove every chunk of ``source``. Returns how many were removed."""
        pids = [p for p, r in self._store.records.items() if r.meta.get("document") == source]
        for pid in pids:
            self._store.remove(pid)
        return len(pids)

    def search(self, query: str, k: int, *, query_vector: np.ndarray | None = None) -> list[Passage]:
        """The ``k`` best chunks for ``query``, best first, as passages."""
        qvec = query_vector if query_vector is not None else self.embedder.encode([query])[0]
        hits = self._store.search(qvec, query, k, self.config)
        return [_passage(self._store.records[h.pid], h) for h in hits]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the collection to folder ``path`` (FAISS + JSON, atomically per file)."""
        folder = Path(path)
        self._store.save(folder)
        _write_json(
            folder / "collection.json",
            {
                "format": _FORMAT,
                "name": self.name,
                "chunk_tokens": self.chunk_tokens,
                "overlap_tokens": self.overlap_tokens,
                "exact_max": self._store.exact_max,
                "config": self.config.to_dict(),
            },
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        embedder: TextEncoder | None = None,
        counter: TokenCounter | None = None,
    ) -> DocumentCollection:
        """Read a collection written by :meth:`save`."""
        folder = Path(path)
        meta = _read_json(folder / "collection.json")
        out = cls(
            meta["name"],
            embedder=embedder,
            counter=counter,
            chunk_tokens=int(meta["chunk_tokens"]),
            overlap_tokens=int(meta["overlap_tokens"]),
            exact_max=int(meta["exact_max"]),
            config=RetrievalConfig(**meta["config"]),
        )
        out._store = _Store.load(folder, out.embedder, exact_max=out._store.exact_max, nprobe=DEFAULT_NPROBE)
        return out


class _NullCounter(TokenCounter):
    """Only used to validate chunking parameters without loading a tokenizer."""

    def encode(self, text: str) -> list[int]:
        return []

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def _message_cost(self, message: Message) -> int:
        return 0

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return 0

    def _overhead_cost(self, starts_with_system: bool) -> int:
        return 0


def _passage(rec: _Record, hit: _Hit, text: str | None = None) -> Passage:
    meta = {k: v for k, v in rec.meta.items() if not k.startswith("_")}
    meta["cosine"] = None if hit.cosine is None else round(hit.cosine, 4)
    meta["bm25"] = round(hit.bm25, 4)
    return Passage(
        text=rec.text if text is None else text,
        score=float(hit.score),
        source=rec.source,
        key=rec.key,
        meta=meta,
    )


# ---------------------------------------------------------------------------------------
# RetrievalMemory: what a session retrieves from
# ---------------------------------------------------------------------------------------


def _mmr(
    ranked: Sequence[int], score: Mapping[int, float], vecs: np.ndarray, lam: float
) -> tuple[list[int], dict[int, float]]:
    """Greedy maximal-marginal-relevance order of ``ranked`` (best first), and new scores.

    Each step takes the candidate with the highest ``score - lam * max cosine`` to those
    already taken; its new score is that value, capped by the previous one so the scores
    stay in the new order (callers sort by score).
    """
    left = list(range(len(ranked)))
    base = np.asarray([score[u] for u in ranked], dtype=np.float64)
    sims = vecs @ vecs.T
    worst = np.full(len(ranked), -np.inf)
    out: list[int] = []
    new: dict[int, float] = {}
    last = np.inf
    while left:
        cur = base[left] - lam * np.maximum(worst[left], 0.0)
        pick = int(np.argmax(cur))
        j = left[pick]
        last = min(last, float(cur[pick]))
        out.append(ranked[j])
        new[ranked[j]] = last
        left.remove(j)
        worst = np.maximum(worst, sims[j])
    return out, new


def _propagate(order: np.ndarray, fused: Mapping[int, float], weight: float, grow: int) -> dict[int, float]:
    """``own + weight * (better neighbour - floor)`` for every candidate.

    ``order`` is ``(2, n)``: the previous and next unit of each unit id (``-1``: none).
    The floor is the lowest fused score; a unit not in ``fused`` scores the floor. The
    neighbours of the best ``grow`` candidates join the candidates (the others' neighbours
    could not climb into the ranking anyway), so a line with no word of the query is
    found through its reply.
    """
    if not fused:
        return {}
    ids = np.fromiter(fused.keys(), dtype=np.int64, count=len(fused))
    vals = np.fromiter(fused.values(), dtype=np.float64, count=len(fused))
    floor = float(vals.min())
    n = order.shape[1]
    inside = (ids >= 0) & (ids < n)
    ids, vals = ids[inside], vals[inside]
    score = np.full(n + 1, floor)  # the last slot stands for "no neighbour"
    score[ids] = vals
    top = ids[np.argpartition(-vals, grow - 1)[:grow]] if 0 < grow < len(ids) else ids
    near = order[:, top]
    cand = np.unique(np.concatenate([ids, near[near >= 0]]))
    nb = order[:, cand]
    nb = np.where(nb >= 0, nb, n)
    best = np.maximum(score[nb[0]], score[nb[1]])
    out = dict(fused)  # a unit the order does not know keeps its score
    out.update(zip(cand.tolist(), (score[cand] + weight * (best - floor)).tolist(), strict=True))
    return out


def _top(score: Mapping[int, float], k: int) -> list[int]:
    """The ``k`` best keys of ``score``, best first (ties: the smaller key first)."""
    if k <= 0 or not score:
        return []
    ids = np.fromiter(score.keys(), dtype=np.int64, count=len(score))
    vals = np.fromiter(score.values(), dtype=np.float64, count=len(score))
    if k < len(ids):
        # Everything tied with the k-th best stays in, so ties break by key as in a full sort.
        kth = np.partition(-vals, k - 1)[k - 1]
        keep = -vals <= kth
        ids, vals = ids[keep], vals[keep]
    order = np.lexsort((ids, -vals))[:k]
    return ids[order].tolist()


def _strip_names(query: str, names: Iterable[str]) -> str:
    """``query`` without the words of ``names`` (and a possessive ``'s`` after them)."""
    words = {w for name in names for w in _WORD.findall(name.lower())}
    if not words:
        return query
    pattern = r"\b(?:" + "|".join(re.escape(w) for w in sorted(words)) + r")(?:'s|’s)?\b"
    stripped = re.sub(pattern, "", query, flags=re.IGNORECASE)
    stripped = re.sub(r"\s+", " ", stripped).strip()
    return stripped if terms(stripped) else query


_TIME_OF_DAY = re.compile(r"^\s*\d{1,2}[:.]\d{2}(?:[:.]\d{2})?\s*(?:[ap]\.?m\.?)?\s*(?:on\s+|,\s*)?", re.I)
_ISO_DAY = re.compile(r"^(\d{4}-\d{2}-\d{2})[T ]\d{2}:\d{2}\S*$")


@functools.lru_cache(maxsize=4096)
def day_label(date: str) -> str:
    """The day of a turn's date, as a short group label: the time of day is dropped
    (``"1:56 pm on 8 May, 2023"`` -> ``"8 May 2023"``, ``"2023-05-08T13:56"`` ->
    ``"2023-05-08"``); a date in another form is kept as it is."""
    text = date.strip()
    m = _ISO_DAY.match(text)
    if m:
        return m.group(1)
    day = _TIME_OF_DAY.sub("", text, count=1)
    day = re.sub(r",\s*(\d{4})\b", r" \1", day).strip()
    return day or text


def _as_day(value: date | str | None) -> date | None:
    """A day from a ``date``, a ``datetime`` or a date string; ``None`` when it has none."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    return parse_day(str(value))


def _speaker_line(message: Message) -> str:
    name = message.name or message.role.value
    content = message.content.strip()
    if content.startswith(f"{name}:"):
        return content
    return f"{name}: {content}"


class _Derived:
    """What the ranking reads per unit of one session's store, kept up to date as turns
    are indexed: each unit's speaker (and the speakers' names), content size, episode, day and
    conversation neighbours, and each episode's mean vector.

    In a chat the store changes before every question (the last turn is indexed), so
    :meth:`update` reads only the records added since it last ran: record ids only grow
    and a record never changes. When records were removed (``forget_turns``) or the
    conversation order would change, it rebuilds from every record.
    """

    def __init__(self, episode_turns: int) -> None:
        self.episode_turns = episode_turns
        self.version = -1
        self.last_pid = -1
        self.records = 0
        self.speaker: dict[int, str] = {}
        self.speakers: set[str] = set()
        self.size: dict[int, int] = {}
        self.episode_of: dict[int, str] = {}
        self.episode_keys: list[str] = []
        self.centroids = np.zeros((0, 0), np.float32)  # normalized, in ``episode_keys`` order
        self._episode_row: dict[str, int] = {}
        self._sums = np.zeros((0, 0), np.float64)
        self._counts = np.zeros(0, np.int64)
        self.days = np.full(0, -1, np.int64)  # by unit id: a proleptic ordinal, -1: none
        self.years: set[int] = set()
        self.order = np.full((2, 0), -1, np.int64)  # by unit id: previous and next unit
        self._last_unit = -1
        self._last_turn = -1

    def update(self, store: _Store) -> _Derived:
        """Up to date with ``store``: this object, or a new one built from every record."""
        if self.version == store.version:
            return self
        new: list[tuple[int, _Record]] = []
        for pid in reversed(store.records):  # record ids grow with insertion
            if pid <= self.last_pid:
                break
            new.append((pid, store.records[pid]))
        new.reverse()
        turn = [int(rec.meta.get("turn", 0)) for _, rec in new]
        if self.records + len(new) != len(store.records) or (turn and min(turn) < self._last_turn):
            return _Derived(self.episode_turns).update(store)  # from every record
        self._add(store, new)
        self.version = store.version
        return self

    def _add(self, store: _Store, new: list[tuple[int, _Record]]) -> None:
        if not new:
            return
        self.last_pid = max(self.last_pid, max(pid for pid, _ in new))
        self.records += len(new)
        top = max((u for _, rec in new for u in rec.units), default=-1) + 1
        if top > len(self.days):
            cap = max(top, 2 * len(self.days))
            days = np.full(cap, -1, np.int64)
            days[: len(self.days)] = self.days
            order = np.full((2, cap), -1, np.int64)
            order[:, : self.order.shape[1]] = self.order
            self.days, self.order = days, order
        touched: dict[str, list[int]] = {}
        # Conversation order: by turn, ties in insertion order (a stable sort).
        for _, rec in sorted(new, key=lambda item: int(item[1].meta.get("turn", 0))):
            self._last_turn = max(self._last_turn, int(rec.meta.get("turn", 0)))
            for u in rec.units:
                if self._last_unit >= 0:
                    self.order[0, u], self.order[1, self._last_unit] = self._last_unit, u
                self._last_unit = u
        for _, rec in new:
            named = rec.meta.get("_speakers") or []
            self.speaker.update(zip(rec.units, named, strict=False))
            self.speakers.update(named[: len(rec.units)])
            lines = rec.meta.get("_lines") or [rec.text]
            self.size.update(zip(rec.units, (len(terms(line)) for line in lines), strict=False))
            date = rec.meta.get("date")
            key = f"date:{date}" if date else f"block:{int(rec.meta.get('turn', 0)) // self.episode_turns}"
            touched.setdefault(key, []).extend(rec.units)
            for u in rec.units:
                self.episode_of[u] = key
            day = parse_day(str(date or ""))
            if day is not None and rec.units:
                self.days[rec.units] = day.toordinal()
                self.years.add(day.year)
        if store.vectors is None:
            return
        for key in touched:
            if key not in self._episode_row:
                self._episode_row[key] = len(self.episode_keys)
                self.episode_keys.append(key)
        k, dim = len(self.episode_keys), store.vectors.dim
        if self._sums.shape != (k, dim):
            sums = np.zeros((k, dim), np.float64)
            sums[: len(self._sums)] = self._sums if self._sums.size else 0.0
            counts = np.zeros(k, np.int64)
            counts[: len(self._counts)] = self._counts
            self._sums, self._counts = sums, counts
        rows = [self._episode_row[key] for key in touched]
        for row, units in zip(rows, touched.values(), strict=True):
            self._sums[row] += store.vectors.vectors(units).sum(axis=0, dtype=np.float64)
            self._counts[row] += len(units)
        if self.centroids.shape != (k, dim):
            cents = np.zeros((k, dim), np.float32)
            cents[: len(self.centroids)] = self.centroids if self.centroids.size else 0.0
            self.centroids = cents
        means = self._sums[rows] / np.maximum(self._counts[rows], 1)[:, None]
        self.centroids[rows] = means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)


class _Vocabulary:
    """A session's words that can expand a query, their vectors and nearest words.

    Words are added as turns are indexed; each keeps its :data:`NEAR_KEPT` nearest words
    (by cosine, best first), updated as new words arrive, so expanding a query costs a
    lookup per query word. Saved with its session (``vocabulary.npz``, no pickle).
    """

    _CHUNK = 256  # new words compared with all others at a time (bounds the memory)

    def __init__(self, dim: int) -> None:
        self.terms: list[str] = []
        self.index: dict[str, int] = {}
        self._vecs = np.zeros((0, dim), dtype=np.float32)
        self._near = np.zeros((0, NEAR_KEPT), dtype=np.int64)  # word ids, -1: none
        self._cos = np.zeros((0, NEAR_KEPT), dtype=np.float32)  # best first, -2: none

    def vectors(self) -> np.ndarray:
        """The words' vectors, in :attr:`terms` order."""
        return self._vecs[: len(self.terms)]

    def nearest(self, word: str) -> list[tuple[str, float]]:
        """``word``'s kept nearest words with their cosines, best first."""
        i = self.index.get(word)
        if i is None:
            return []
        return [(self.terms[j], float(c)) for j, c in zip(self._near[i], self._cos[i], strict=True) if j >= 0]

    def _grow(self, size: int) -> None:
        if size <= len(self._vecs):
            return
        cap = max(2 * len(self._vecs), size, 64)
        n = len(self.terms)

        def grown(a: np.ndarray, fill: float) -> np.ndarray:
            out = np.full((cap, a.shape[1]), fill, dtype=a.dtype)
            out[:n] = a[:n]
            return out

        self._vecs, self._near, self._cos = (
            grown(self._vecs, 0.0),
            grown(self._near, -1),
            grown(self._cos, -2.0),
        )

    def add(self, words: Sequence[str], vectors: np.ndarray) -> None:
        """Add ``words`` with their normalized vectors; update every word's nearest."""
        for start in range(0, len(words), self._CHUNK):
            self._add(words[start : start + self._CHUNK], vectors[start : start + self._CHUNK])

    def _add(self, words: Sequence[str], vectors: np.ndarray) -> None:
        n, m = len(self.terms), len(words)
        if not m:
            return
        self._grow(n + m)
        self._vecs[n : n + m] = vectors
        for k, word in enumerate(words):
            self.index[word] = n + k
            self.terms.append(word)
        sims = self._vecs[: n + m] @ self._vecs[n : n + m].T  # (all words, new words)
        for k in range(m):
            i = n + k
            col = sims[:, k].copy()
            col[i] = -2.0
            # The new word's own nearest, among all words (the other new ones too) ...
            top = np.arange(len(col))
            if len(col) > NEAR_KEPT:
                top = np.argpartition(-col, NEAR_KEPT)[:NEAR_KEPT]
            top = top[np.argsort(-col[top], kind="stable")]
            top = top[col[top] > -2.0]
            self._near[i, : len(top)], self._cos[i, : len(top)] = top, col[top]
            # ... and the earlier words it is now among the nearest of.
            for j in np.flatnonzero(col[:n] > self._cos[:n, -1]).tolist():
                pos = int(np.searchsorted(-self._cos[j], -col[j], side="right"))
                self._near[j, pos + 1 :] = self._near[j, pos:-1].copy()
                self._cos[j, pos + 1 :] = self._cos[j, pos:-1].copy()
                self._near[j, pos], self._cos[j, pos] = i, col[j]

    def save(self, path: Path) -> None:
        n = len(self.terms)
        buf = io.BytesIO()
        np.savez(
            buf,
            terms=np.asarray(self.terms, dtype=str),
            vectors=self.vectors(),
            near=self._near[:n],
            cosines=self._cos[:n],
        )
        _write_atomic(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path, dim: int) -> _Vocabulary | None:
        """The vocabulary saved at ``path``, or ``None`` when there is none that fits (it
        is then rebuilt from the session's words on first use)."""
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                words = data["terms"].tolist()
                vecs, near, cos = data["vectors"], data["near"], data["cosines"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            return None
        n = len(words)
        if vecs.shape != (n, dim) or near.shape != (n, NEAR_KEPT) or cos.shape != (n, NEAR_KEPT):
            return None
        out = cls(dim)
        out._grow(n)
        out.terms = [str(t) for t in words]
        out.index = {t: i for i, t in enumerate(out.terms)}
        out._vecs[:n], out._near[:n], out._cos[:n] = vecs, near, cos
        return out


class RetrievalMemory:
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
        self._sessions: dict[str, _Store] = {}
        self._derived_of: dict[int, _Derived] = {}
        self._vocab: dict[int, _Vocabulary] = {}
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
        last_lines: dict[int, str] = {}  # of this call's turns: not in the store yet
        for turn in turns:
            msgs = [m for m in turn.messages if m.content.strip()]
            if not msgs:
                continue
            lines = [_speaker_line(m) for m in msgs]
            last_lines[turn.index] = lines[-1]
            date = (dates or {}).get(turn.index)
            head = f"[{date}]\n" if date and self.config.date_in_text else ""
            dense = list(lines)
            if self.config.neighbours:
                # A short reply ("Yes, last week!") is findable by what it answers.
                # The previous turn's last line: indexed with this one or before.
                prev = last_lines.get(turn.index - 1) or self._last_line(store, turn.index)
                ctx = [prev, *lines[:-1]]
                dense = [f"{c}\n{line}" if c else line for c, line in zip(ctx, lines, strict=True)]
            meta: dict[str, Any] = {
                "session_id": session_id,
                "turn": turn.index,
                "_lines": lines,
                "_speakers": [m.name or m.role.value for m in msgs],
            }
            if date:
                meta["date"] = date
            rec = _Record(
                text=head + "\n".join(lines), source=f"turn {turn.index}", key=turn_key(turn.index), meta=meta
            )
            items.append((rec, dense, dense))
        store.add(items)
        if self.config.expand_terms > 0 and items:
            self._vocabulary(store, [t for _, texts, _ in items for text in texts for t in terms(text)])

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
        n = top_k * self.config.candidates_factor
        sources = [s for s in [self._sessions.get(session_id)] if s is not None and len(s)]
        colls = [*self._shared, *self._attached.get(session_id, [])]
        if not sources and not any(len(c) for c in colls):
            return []
        vectors: dict[str, np.ndarray] = {}
        asked_on = _as_day(today)

        def vector(text: str) -> np.ndarray:
            if text not in vectors:
                vectors[text] = self.embedder.encode([text])[0]
            return vectors[text]

        found: list[Passage] = []
        for store in sources:
            named = self._named_speakers(store, query) if self.config.speaker_boost > 0 else set()
            text = _strip_names(query, named) if self.config.strip_names else query
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

    def _store(self, session_id: str) -> _Store:
        if not isinstance(session_id, str) or not session_id:
            raise ConfigError("session_id must be a non-empty string")
        store = self._sessions.get(session_id)
        if store is None:
            store = _Store(self.embedder, exact_max=self.exact_max, nprobe=DEFAULT_NPROBE)
            self._sessions[session_id] = store
        return store

    def _search_turns(
        self,
        store: _Store,
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
        k = max(cfg.unit_candidates, 4 * n)
        fused, dense, lexical = store.unit_scores(qvec, query, k, cfg)
        if not fused:
            return []
        if cfg.second_hop > 0 and store.vectors is not None:
            seeds = self._hop_seeds(store, fused, self._boosted_ranking(store, fused, named))
            q2 = qvec + store.vectors.vectors(seeds).mean(axis=0)
            q2 = (q2 / (np.linalg.norm(q2) or 1.0)).astype(np.float32)
            extra = store.lexical.rare_terms(
                (store.unit_lex[u] for u in seeds), cfg.hop_terms, exclude=terms(query)
            )
            if cfg.expand_terms > 0 or cfg.expand_query_words > 0:
                extra += [t for t in self._expansion(store, query, qvec) if t not in extra]
            # The new words may find new units; the new vector only re-scores the units
            # found so far (a second full vector search would double the search time).
            lexical2 = dict(store.lexical.search(query, k, extra)) if cfg.fusion is not Fusion.DENSE else {}
            dense2: dict[int, float] = {}
            if cfg.fusion is not Fusion.LEXICAL:
                cand = list(fused.keys() | lexical2.keys())
                dense2 = dict(zip(cand, (store.vectors.vectors(cand) @ q2).tolist(), strict=True))
            fused2 = _fuse(dense2, lexical2, cfg)
            floor1, floor2 = min(fused.values()), min(fused2.values(), default=0.0)
            h = cfg.second_hop
            fused = {
                u: (1 - h) * fused.get(u, floor1) + h * fused2.get(u, floor2)
                for u in fused.keys() | fused2.keys()
            }
        if cfg.episode_weight > 0 and store.vectors is not None:
            keys, cents, of_unit = self._episodes(store)
            ep_score = dict(zip(keys, (cents @ qvec).tolist(), strict=True))
            for u in fused:
                fused[u] += cfg.episode_weight * ep_score[of_unit[u]]
        if cfg.time_weight > 0:
            fused = self._time_scored(store, fused, asked or query, today)
        if cfg.neighbour_weight > 0:
            fused = _propagate(self._order(store), fused, cfg.neighbour_weight, 2 * max(n, 1))
        if cfg.content_weight > 0:
            size = self._content_sizes(store)
            full = float(cfg.content_terms)
            for u in fused:
                fused[u] += cfg.content_weight * min(size.get(u, 0) / full, 1.0)
        if named:
            speaker = self._speakers(store)
            fused = {
                u: sc + (cfg.speaker_boost if speaker.get(u) in named else 0.0) for u, sc in fused.items()
            }
        if cfg.turn_lines != "each":
            return [self._turn_passage(store.records[h.pid], h) for h in store.hits(fused, dense, lexical, n)]
        ranked = _top(fused, max(n, 1) * 2)
        if cfg.mmr_lambda > 0 and store.vectors is not None:
            ranked, fused = _mmr(ranked, fused, store.vectors.vectors(ranked), cfg.mmr_lambda)
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
        self, store: _Store, uid: int, score: float, cosine: float | None, bm25: float
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
                meta["group"] = day_label(str(date))
            else:
                text = f"[{date}]\n{line}"
        turn = int(rec.meta.get("turn", 0))
        return Passage(
            text=text, score=float(score), source=f"turn {turn}", key=turn_key(turn, pos), meta=meta
        )

    def _derived(self, store: _Store) -> _Derived:
        """What the ranking reads per unit of ``store``, up to date (see :class:`_Derived`)."""
        derived = self._derived_of.get(id(store)) or _Derived(self.config.episode_turns)
        derived = self._derived_of[id(store)] = derived.update(store)
        return derived

    def _order(self, store: _Store) -> np.ndarray:
        """``(2, n)`` int64: each unit's previous and next message in conversation order,
        by unit id, ``-1`` for none."""
        return self._derived(store).order

    def _speakers(self, store: _Store) -> dict[int, str]:
        """Each unit's speaker."""
        return self._derived(store).speaker

    def _content_sizes(self, store: _Store) -> dict[int, int]:
        """Each unit's count of content words (its own line, not the context line)."""
        return self._derived(store).size

    def _named_speakers(self, store: _Store, query: str) -> set[str]:
        """Speakers of ``store`` whose name (any word of it) appears in ``query``."""
        words = set(_WORD.findall(query.lower()))
        names = self._derived(store).speakers
        return {sp for sp in names if set(_WORD.findall(sp.lower())) & words}

    def _boosted_ranking(self, store: _Store, fused: Mapping[int, float], named: set[str]) -> list[int]:
        boost = self.config.speaker_boost
        speaker = self._speakers(store)
        score = {u: sc + (boost if named and speaker.get(u) in named else 0.0) for u, sc in fused.items()}
        return sorted(score, key=lambda u: (-score[u], u))

    def _vocabulary(self, store: _Store, new_terms: Iterable[str] | None = None) -> _Vocabulary:
        """The store's expansion vocabulary: words two or more of its messages use. Built
        on first use from every indexed word, then extended by :meth:`remember_turns`
        with the words it indexed (``new_terms``). Words of forgotten turns stay (the
        expansion skips words no message uses any more)."""
        vocab = self._vocab.get(id(store))
        if vocab is None:
            vocab = self._vocab[id(store)] = _Vocabulary(self.embedder.dim)
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

    def _expansion(self, store: _Store, query: str, qvec: np.ndarray | None = None) -> list[str]:
        """Words of the session's vocabulary nearest to the query's words, then to the
        query's vector ``qvec`` (see ``expand_terms`` and ``expand_query_words``)."""
        cfg = self.config
        vocab = self._vocabulary(store)
        df = store.lexical.document_frequency
        cap = max(2, int(cfg.expand_max_share * len(store.lexical)))

        def usable(word: str) -> bool:  # still used, and not too common
            return 0 < df(word) <= cap

        asked = list(dict.fromkeys(terms(query)))
        out: list[str] = []
        for word in asked if cfg.expand_terms > 0 else ():
            taken = 0
            for near, cosine in vocab.nearest(word):
                if taken >= cfg.expand_terms or cosine < cfg.expand_min_cosine:
                    break
                if usable(near):
                    taken += 1
                    if near not in out:
                        out.append(near)
        vecs = vocab.vectors()
        if cfg.expand_query_words > 0 and qvec is not None and len(vecs):
            sims = vecs @ qvec
            look = min(len(sims), 8 * cfg.expand_query_words)
            top = np.argpartition(-sims, look - 1)[:look]
            taken = 0
            for j in top[np.argsort(-sims[top], kind="stable")].tolist():
                if taken >= cfg.expand_query_words or sims[j] < cfg.expand_query_min_cosine:
                    break
                word = vocab.terms[j]
                if word not in asked and usable(word):
                    taken += 1
                    if word not in out:
                        out.append(word)
        return out

    def _hop_seeds(self, store: _Store, fused: Mapping[int, float], ranking: Sequence[int]) -> list[int]:
        """The first hits the second query is built from: the best ones, not the
        also-rans (half the best score at least), one per episode with
        ``hop_distinct_days``."""
        cfg = self.config
        good = [u for u in ranking[: 4 * cfg.hop_seeds] if fused[u] >= 0.5 * fused[ranking[0]]]
        if not cfg.hop_distinct_days:
            return good[: cfg.hop_seeds]
        of_unit = self._episodes(store)[2]
        seeds: list[int] = []
        days: set[str] = set()
        for u in good:
            if of_unit[u] not in days:
                days.add(of_unit[u])
                seeds.append(u)
        return seeds[: cfg.hop_seeds]

    def _episodes(self, store: _Store) -> tuple[list[str], np.ndarray, dict[int, str]]:
        """Episode keys, their normalized mean vectors and each unit's episode."""
        d = self._derived(store)
        return d.episode_keys, d.centroids, d.episode_of

    def _days(self, store: _Store) -> tuple[np.ndarray, tuple[int, ...]]:
        """Each unit's day, by unit id (a proleptic ordinal, ``-1`` where the turn has no
        readable date), and the years those days fall in."""
        d = self._derived(store)
        return d.days, tuple(sorted(d.years))

    def _time_scored(
        self, store: _Store, fused: dict[int, float], question: str, today: date | None
    ) -> dict[int, float]:
        """``fused`` raised for the messages of the days ``question`` names (see
        ``time_weight``); those days' messages join the candidates when they are few."""
        cfg = self.config
        days, years = self._days(store)
        if not fused or not years:
            return fused
        # A month or day named without a year: in the years the turns were dated in.
        spans = time_spans(question, years, today=today)
        if not spans:
            return fused
        near = np.zeros(len(days))
        for span in spans:
            lo = span.first.toordinal() if span.first != date.min else -(10**9)
            hi = span.last.toordinal() if span.last != date.max else 10**9
            dist = np.maximum(lo - days, 0) + np.maximum(days - hi, 0)
            near = np.maximum(near, np.clip(1.0 - dist / cfg.time_grace_days, 0.0, 1.0))
        near[days < 0] = 0.0
        out = dict(fused)
        inside = np.flatnonzero(near >= 1.0)
        if 0 < len(inside) <= cfg.time_candidates:
            floor = min(fused.values())
            for u in inside.tolist():
                out.setdefault(u, floor)
        ids = np.fromiter(out.keys(), dtype=np.int64, count=len(out))
        known = ids[(ids >= 0) & (ids < len(days))]
        gain = cfg.time_weight * near[known]
        for u, g in zip(known[gain > 0].tolist(), gain[gain > 0].tolist(), strict=True):
            out[u] += g
        return out

    @staticmethod
    def _adjacent(store: _Store, uid: int, width: int) -> list[int]:
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

    def _turn_passage(self, rec: _Record, hit: _Hit) -> Passage:
        """A turn as a passage: the whole turn, or only its best-matching line(s)."""
        lines: list[str] = rec.meta.get("_lines") or []
        if self.config.turn_lines == "all" or len(lines) <= 1:
            return _passage(rec, hit)
        keep = lines[max(0, hit.unit - self.config.context_lines) : hit.unit + 1]
        date = rec.meta.get("date")
        head = f"[{date}]\n" if date and self.config.date_in_text else ""
        return _passage(rec, hit, head + "\n".join(keep))

    @staticmethod
    def _last_line(store: _Store, index: int) -> str:
        pid = store.by_key.get(turn_key(index - 1))
        if pid is None:
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
            store.save(folder / "sessions" / sub)
            vocab = self._vocab.get(id(store))
            if vocab is not None:
                vocab.save(folder / "sessions" / sub / "vocabulary.npz")
            sessions[sid] = sub
        collections = {}
        for coll in self._shared:
            sub = "c-" + hashlib.sha1(coll.name.encode("utf-8")).hexdigest()[:16]
            coll.save(folder / "collections" / sub)
            collections[coll.name] = sub
        _write_json(
            folder / "memory.json",
            {
                "format": _FORMAT,
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

        Raises:
            StoreError: a file is missing or inconsistent.
        """
        folder = Path(path)
        meta = _read_json(folder / "memory.json")
        out = cls(embedder, config=RetrievalConfig(**meta["config"]), exact_max=int(meta["exact_max"]))
        out.min_score = float(meta["min_score"])
        for sid, sub in meta["sessions"].items():
            store = out._sessions[sid] = _Store.load(
                folder / "sessions" / sub, out.embedder, exact_max=out.exact_max, nprobe=DEFAULT_NPROBE
            )
            vocab = _Vocabulary.load(folder / "sessions" / sub / "vocabulary.npz", out.embedder.dim)
            if vocab is not None:  # else rebuilt on first use
                out._vocab[id(store)] = vocab
                out._word_vectors.update(zip(vocab.terms, vocab.vectors(), strict=True))
        for sub in meta["collections"].values():
            out._shared.append(
                DocumentCollection.load(folder / "collections" / sub, embedder=out.embedder, counter=counter)
            )
        return out


def __getattr__(name: str) -> Any:
    if name == "Memory":  # the old name, kept for one release
        import warnings

        warnings.warn(
            "convo.retrieval.Memory is deprecated; use convo.RetrievalMemory",
            DeprecationWarning,
            stacklevel=2,
        )
        return RetrievalMemory
    raise AttributeError(f"module 'convo.retrieval' has no attribute {name!r}")
