"""The vocabulary's nearest words are kept by whole chunks of new words at a time (issue
24: one pass per word was most of a 10,000-turn rebuild); what each word keeps must be
its true nearest, however the words arrived."""

from __future__ import annotations

import numpy as np
import pytest

from convo.retrieval.expansion import NEAR_KEPT, Vocabulary


def brute_force(vecs: np.ndarray) -> list[list[int]]:
    """Each word's NEAR_KEPT best others by inner product, a tie by the lower id."""
    sims = vecs @ vecs.T
    out = []
    for i in range(len(vecs)):
        others = [j for j in range(len(vecs)) if j != i]
        out.append(sorted(others, key=lambda j: (-sims[i, j], j))[:NEAR_KEPT])
    return out


@pytest.mark.parametrize("chunks", [[1, 1, 1], [3, 20], [5] * 12, [300], [250, 7, 40, 1]])
def test_nearest_words_are_the_true_nearest_with_ties(chunks: list[int]) -> None:
    # Small integer vectors: products are exact, and ties are many.
    rng = np.random.default_rng(sum(chunks))
    vecs = rng.integers(-2, 3, size=(sum(chunks), 6)).astype(np.float32)
    vocab = Vocabulary(6)
    start = 0
    for size in chunks:
        vocab.add([f"w{i}" for i in range(start, start + size)], vecs[start : start + size])
        start += size
    want = brute_force(vecs)
    sims = vecs @ vecs.T
    for i, word in enumerate(vocab.terms):
        got = vocab.nearest(word)
        # The best cosines, best first (which of several tied words is kept is not fixed) ...
        assert [c for _, c in got] == [float(sims[i, j]) for j in want[i]], word
        # ... each the cosine of the word named, never the word itself, none twice.
        ids = [vocab.index[w] for w, _ in got]
        assert all(float(sims[i, j]) == c for j, (_, c) in zip(ids, got, strict=True))
        assert i not in ids and len(set(ids)) == len(ids)
