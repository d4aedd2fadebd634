"""The two indexes every retrieval store keeps over the same units: dense vectors
(:class:`VectorIndex`, FAISS) and words (:class:`BM25Index`)."""

from __future__ import annotations

from convo.retrieval.indexes.bm25 import BM25Index, terms
from convo.retrieval.indexes.vector import DEFAULT_EXACT_MAX, DEFAULT_NPROBE, VectorIndex

__all__ = ["DEFAULT_EXACT_MAX", "DEFAULT_NPROBE", "BM25Index", "VectorIndex", "terms"]
