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

The package, one part per module:

::

    config.py          RetrievalConfig (every ranking option), Fusion
    indexes/vector.py  VectorIndex: FAISS inner product, exact then IVF
    indexes/bm25.py    BM25Index, terms() and the stemmer
    units.py           UnitStore: passages, their units, both indexes, passages.json
    documents.py       chunk_text(), Chunk, DocumentCollection
    ranking.py         the ranking stages: fusion, second-hop seeds, time, neighbours, MMR
    turn_ranking.py    rank_units(): those stages over a session's messages, on arrays
    features.py        UnitFeatures: speakers, episodes, days, order, kept up to date
    expansion.py       Vocabulary and query expansion (vocabulary.npz)
    memory.py          RetrievalMemory: per-session stores, retrieve(), save/load (memory.json)
    _io.py             atomic writes, JSON reads
"""

from __future__ import annotations

import warnings
from typing import Any

from convo.dates import day_label
from convo.retrieval.config import TURN_LINES, Fusion, RetrievalConfig
from convo.retrieval.documents import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    Chunk,
    DocumentCollection,
    chunk_text,
)
from convo.retrieval.expansion import NEAR_KEPT
from convo.retrieval.indexes import DEFAULT_EXACT_MAX, DEFAULT_NPROBE, BM25Index, VectorIndex, terms
from convo.retrieval.memory import RetrievalMemory
from convo.retrieval.scopes import ScopedMemory

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_EXACT_MAX",
    "DEFAULT_NPROBE",
    "DEFAULT_OVERLAP_TOKENS",
    "NEAR_KEPT",
    "TURN_LINES",
    "BM25Index",
    "Chunk",
    "DocumentCollection",
    "Fusion",
    "RetrievalConfig",
    "RetrievalMemory",
    "ScopedMemory",
    "VectorIndex",
    "chunk_text",
    "day_label",
    "terms",
]


def __getattr__(name: str) -> Any:
    if name == "Memory":  # the old name, kept for one release
        warnings.warn(
            "convo.retrieval.Memory is deprecated; use convo.RetrievalMemory",
            DeprecationWarning,
            stacklevel=2,
        )
        return RetrievalMemory
    raise AttributeError(f"module 'convo.retrieval' has no attribute {name!r}")
