"""Query expansion: a session's :class:`Vocabulary` and the words it adds to a search.

The vocabulary holds the words two or more of a session's messages use, each with its
vector (the embedder on the word alone) and its :data:`NEAR_KEPT` nearest words, kept up
to date as turns are indexed. :func:`expansion_words` looks up the words near a query's
words and near the query's vector ("passionate" -> "passion"; "What instruments does she
play?" -> "piano"); the second hop searches them too.
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from convo.retrieval._io import write_atomic
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.indexes.bm25 import BM25Index, terms

#: Nearest words each vocabulary word keeps for query expansion (at least
#: ``RetrievalConfig.expand_terms``; the spare ones stand in for words grown too common).
NEAR_KEPT = 8

logger = logging.getLogger(__name__)


class Vocabulary:
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
        # Each new word's own nearest, among all words (the other new ones too), in one
        # pass over the chunk (a loop per word, an argpartition over every word each, was
        # most of a 10,000-turn rebuild: issue 24) ...
        own = np.ascontiguousarray(sims.T)  # (new words, all words)
        own[np.arange(m), n + np.arange(m)] = -2.0  # not its own neighbour
        top = np.broadcast_to(np.arange(n + m), (m, n + m))
        if n + m > NEAR_KEPT:
            top = np.argpartition(-own, NEAR_KEPT, axis=1)[:, :NEAR_KEPT]
        self._near[n : n + m], self._cos[n : n + m] = _best(np.take_along_axis(own, top, axis=1), top)
        if not n:
            return
        # ... and the earlier words some new word is now among the nearest of: what they
        # kept merged with the new words' best (on a tie the word kept earlier stays first).
        earlier = sims[:n]  # (earlier words, new words)
        rows = np.flatnonzero(earlier.max(axis=1) > self._cos[:n, -1])
        if not len(rows):
            return
        cand = earlier[rows]
        ids = np.broadcast_to(np.arange(n, n + m), cand.shape)
        if m > NEAR_KEPT:
            pick = np.argpartition(-cand, NEAR_KEPT, axis=1)[:, :NEAR_KEPT]
            cand, ids = np.take_along_axis(cand, pick, axis=1), np.take_along_axis(ids, pick, axis=1)
        new_ids, new_cos = _best(cand, ids)
        cos = np.concatenate([self._cos[rows], new_cos], axis=1)
        near = np.concatenate([self._near[rows], new_ids], axis=1)
        order = np.argsort(-cos, axis=1, kind="stable")[:, :NEAR_KEPT]
        self._cos[rows] = np.take_along_axis(cos, order, axis=1)
        self._near[rows] = np.take_along_axis(near, order, axis=1)

    def save(self, path: Path, *, owner: str) -> None:
        """Write the vocabulary to ``path`` (``.npz``, no pickle), recording ``owner``."""
        n = len(self.terms)
        buf = io.BytesIO()
        np.savez(
            buf,
            terms=np.asarray(self.terms, dtype=str),
            vectors=self.vectors(),
            near=self._near[:n],
            cosines=self._cos[:n],
            owner=np.asarray(owner, dtype=str),
        )
        write_atomic(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path, dim: int, *, owner: str) -> Vocabulary | None:
        """The vocabulary saved at ``path`` for ``owner``, or ``None`` when there is none
        that fits (it is then rebuilt from the session's words on first use): a file that
        is damaged, of another owner, of vectors of another length, with nearest-word ids
        outside its words or values that are not finite."""
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                words = data["terms"]
                vecs, near, cos = data["vectors"], data["near"], data["cosines"]
                saved_owner = str(data["owner"]) if "owner" in data.files else owner
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            logger.warning("%s cannot be read (%s); the vocabulary will be rebuilt", path, exc)
            return None
        problem = _misfit(words, vecs, near, cos, dim)
        if saved_owner != owner:
            problem = f"it belongs to {saved_owner!r}, not {owner!r}"
        if problem:
            logger.warning("%s does not fit: %s; the vocabulary will be rebuilt", path, problem)
            return None
        n = len(words)
        out = cls(dim)
        out._grow(n)
        out.terms = [str(t) for t in words.tolist()]
        out.index = {t: i for i, t in enumerate(out.terms)}
        out._vecs[:n], out._near[:n], out._cos[:n] = vecs, near, cos
        return out


def _best(cos: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the :data:`NEAR_KEPT` best of candidate ``ids`` by cosine ``cos`` (both
    ``(rows, k)``), best first, a tie by the lower id; short rows, and candidates at -2
    (none), are filled with id -1 and cosine -2."""
    rows = cos.shape[0]
    order = np.lexsort((ids, -cos), axis=1)[:, :NEAR_KEPT]
    best_cos = np.take_along_axis(cos, order, axis=1)
    best_ids = np.take_along_axis(ids, order, axis=1).astype(np.int64)
    out_ids = np.full((rows, NEAR_KEPT), -1, dtype=np.int64)
    out_cos = np.full((rows, NEAR_KEPT), -2.0, dtype=np.float32)
    out_ids[:, : order.shape[1]], out_cos[:, : order.shape[1]] = best_ids, best_cos
    none = out_cos <= -2.0
    out_ids[none], out_cos[none] = -1, -2.0
    return out_ids, out_cos


def _misfit(words: np.ndarray, vecs: np.ndarray, near: np.ndarray, cos: np.ndarray, dim: int) -> str:
    """Why saved vocabulary arrays cannot be used (``""``: they can)."""
    n = len(words)
    if words.ndim != 1 or words.dtype.kind != "U":
        return "the words are not a list of strings"
    if vecs.shape != (n, dim) or near.shape != (n, NEAR_KEPT) or cos.shape != (n, NEAR_KEPT):
        return f"the arrays' shapes do not fit {n} words of {dim} dimensions"
    if len(set(words.tolist())) != n:
        return "a word is listed twice"
    if near.dtype.kind not in "iu" or vecs.dtype.kind != "f" or cos.dtype.kind != "f":
        return "an array has the wrong type"
    if near.size and (near.min() < -1 or near.max() >= n):
        return f"a nearest-word id is outside [-1, {n})"
    if not (np.isfinite(vecs).all() and np.isfinite(cos).all()):
        return "a value is not finite"
    if not np.array_equal(near < 0, cos == -2.0):
        return "the nearest words and their cosines disagree"
    return ""


def expansion_words(
    vocab: Vocabulary, lexical: BM25Index, query: str, qvec: np.ndarray | None, config: RetrievalConfig
) -> list[str]:
    """Words of ``vocab`` nearest to the query's words, then to the query's vector
    ``qvec`` (see ``expand_terms`` and ``expand_query_words`` of
    :class:`~convo.retrieval.RetrievalConfig`). A word is used only while ``lexical`` (the
    session's index) still holds it, in at most ``expand_max_share`` of its messages."""
    cfg = config
    df = lexical.document_frequency
    cap = max(2, int(cfg.expand_max_share * len(lexical)))

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
