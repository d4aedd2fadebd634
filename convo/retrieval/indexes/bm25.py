"""Okapi BM25 over an id -> text collection, and the terms it indexes.

:func:`terms` turns a text into BM25 terms: lowercase words (:data:`WORD`), the
:data:`STOPWORDS` dropped, each lightly stemmed by :func:`stem` ("paint", "painting",
"paints", "painted" are one term).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from convo.errors import ConfigError

#: Words too common to tell messages apart: never indexed, never searched.
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we
    were what when where which while who whom why will with would you your yours yourself
    yourselves s t don ll m re ve d yes oh hey wow really also""".split()
)
#: A word: a run of letters or digits (``_`` splits words).
WORD = re.compile(r"[^\W_]+")


def stem(word: str) -> str:
    """``word`` without a common English suffix (``"painting"`` -> ``"paint"``, ``"running"``
    -> ``"run"``, ``"stories"`` -> ``"story"``); at least three letters are kept."""
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


#: Words whose stems are kept (LRU): a history's words repeat, and stemming each again
#: was most of the word index's build time (issue 24). About 100 bytes a word.
STEM_CACHE_WORDS = 65_536

_stem = functools.lru_cache(maxsize=STEM_CACHE_WORDS)(stem)

#: A search sums each document's term scores in an array indexed by id (no sort) while
#: the ids stay below this many times the document count (plus 1,024); larger ids (a
#: caller's own sparse ids) are summed through a sort.
DENSE_IDS_FACTOR = 4


def terms(text: str) -> list[str]:
    """The BM25 terms of ``text``: lowercase words, stopwords dropped, lightly stemmed."""
    return [_stem(w) for w in WORD.findall(text.lower()) if w not in STOPWORDS]


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
        # Documents added since a term's arrays were built: (id, tf, length), appended to
        # them on next use. In a chat every new message uses common words whose arrays
        # hold thousands of documents; rebuilding those for each question cost more than
        # the search (issue 24).
        self._appended: dict[str, list[tuple[int, int, int]]] = {}

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
        length = sum(tf.values())
        for term, n in tf.items():
            self._postings.setdefault(term, {})[doc_id] = n
            if term in self._arrays:  # appended on next use, not rebuilt from every posting
                self._appended.setdefault(term, []).append((doc_id, n, length))
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
            self._appended.pop(term, None)
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
        extra = self._appended.pop(term, None)
        if cached is not None and extra:
            ids, tfs, lens = cached
            more = np.asarray(extra, dtype=np.int64).reshape(-1, 3)
            cached = self._arrays[term] = (
                np.concatenate([ids, more[:, 0]]),
                np.concatenate([tfs, more[:, 1].astype(np.float64)]),
                np.concatenate([lens, more[:, 2].astype(np.float64)]),
            )
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
        ids, weights = np.concatenate(all_ids), np.concatenate(all_scores)
        lo, hi = int(ids.min()), int(ids.max())
        if lo >= 0 and hi < DENSE_IDS_FACTOR * (n + 1024):
            # Ids are small (a store's growing ids): sum by id in an array, no sort. The
            # sums are the same floats as below (each id's terms added in the same order).
            found = np.flatnonzero(np.bincount(ids, minlength=hi + 1))
            return found, np.bincount(ids, weights=weights, minlength=hi + 1)[found]
        uniq, inverse = np.unique(ids, return_inverse=True)
        return uniq, np.bincount(inverse, weights=weights, minlength=len(uniq))

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
        ids, scores = self.top(query, k, extra_terms)
        return list(zip(ids.tolist(), scores.tolist(), strict=True))

    def top(self, query: str, k: int, extra_terms: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` as two arrays, ``(ids, scores)`` (int64, float64), best first
        (a tie: the smaller id first)."""
        ids, scores = self._score_arrays(query, extra_terms)
        k = max(int(k), 0)
        if k < len(ids):
            top = np.argpartition(-scores, k - 1)[:k] if k else np.zeros(0, np.int64)
            ids, scores = ids[top], scores[top]
        order = np.lexsort((ids, -scores))
        return ids[order], scores[order]

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
