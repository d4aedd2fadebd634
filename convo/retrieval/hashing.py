"""A model-free text encoder: words hashed into buckets (tests, the fake engine, demos).

Not a semantic model: two texts are near when they share words. It needs no download,
so ``convo serve`` with the test engine (``CONVO_FAKE_ENGINE=1``) or with
:data:`FAKE_EMBEDDER_ENV` set has retrieval memory without a model, and tests can count
what it was asked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from convo.retrieval.indexes.bm25 import terms

__all__ = ["FAKE_EMBEDDER_ENV", "HashingEncoder"]

#: ``convo serve`` uses a :class:`HashingEncoder` for memory when this is ``"1"``
#: (test-only, beside ``CONVO_FAKE_ENGINE``).
FAKE_EMBEDDER_ENV = "CONVO_FAKE_EMBEDDER"


class HashingEncoder:
    """Bag of words hashed into ``dim`` buckets, L2-normalized: deterministic and fast.

    Args:
        dim: vector length. Default 256.

    Attributes:
        texts_encoded: how many texts :meth:`encode` was given in all.
    """

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim
        self.texts_encoded = 0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.texts_encoded += len(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for w in terms(text):
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % self.dim] += 1.0
            norm = np.linalg.norm(out[i])
            if norm:
                out[i] /= norm
        return out
